#!/usr/bin/env bash
# `make bench`: every benchmark at the sizes that fit 30 minutes on a 2-core machine, each one
# writing its own section of docs/benchmarks.md (a rerun replaces the section of the same title).
# Prints each benchmark's wall time and the total; stops at the first that fails. Each write also
# regenerates the index of docs/benchmarks.md (benchmarks/index.py). The benchmarks of Horovod
# itself (allreduce bandwidth, Tensor Fusion) are investigations now: docs/investigations/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
# The 5-seed, two-framework compression table takes about 30 minutes by itself:
#   $PY benchmarks/compression.py --seeds 5 --frameworks torch,tensorflow
BENCHES=(
  "benchmarks/overhead.py --framework torch --rounds 20"
  "benchmarks/overhead.py --framework tensorflow --rounds 10"
  "benchmarks/startup.py --framework torch --rounds 8"
  "benchmarks/startup.py --framework tensorflow --rounds 8"
  "benchmarks/frameworks.py --rounds 10"
  "benchmarks/monitoring.py --framework torch --rounds 8 --epochs 20"
  "benchmarks/ddp.py --rounds 2"
  "benchmarks/scaling.py --rounds 2"
  "benchmarks/compression.py --seeds 1 --frameworks torch"
  "benchmarks/checkpoint.py --rounds 30"
  "benchmarks/elastic_recovery.py --trials 1"
  "scripts/soak_checkpoint.py --trials 20 --record docs/benchmarks.md"
)
# Every other driver of benchmarks/, with why `make bench` leaves it out; each section of
# docs/benchmarks.md gives its command. tests/unit/test_bench_list.py checks that every driver is
# in one of the two lists. `bash benchmarks/all.sh --list` prints both.
declare -A OTHERS=(
  [cluster.py]="needs root: the namespace cluster on shaped links; one --part a run"
  [ps_links.py]="needs root: the namespace cluster; about 30 minutes"
  [plan_check.py]="needs root: the namespace cluster; about 25 minutes"
  [plan_heldout.py]="needs root: the namespace cluster; a prediction committed before its measurement"
  [mpi_tcp.py]="needs root: the namespace cluster; an investigation of Open MPI over TCP"
  [shard_link.py]="needs root: the namespace cluster at 100 Mbit/s; about 8 minutes a round"
  [data.py]="both frameworks' loading and memory parts: longer than make bench's 30 minutes leave room for"
  [pipeline_tf.py]="the bubble at three micro-batch counts: longer than make bench's 30 minutes leave room for"
  [ps_async.py]="asp against bsp with a slowed worker: longer than make bench's 30 minutes leave room for"
  [ps_memory.py]="peak memory, not time: run beside shard_memory.py"
  [shard_memory.py]="about 20 minutes at 2 and 4 ranks of a 150 M-parameter GPT"
  [shard_elastic_commit.py]="elastic jobs of a 4.3 M-parameter MLP: about 10 minutes a round on a busy machine"
  [shard_memory_profile.py]="a profile of one job, not a claim: the phases of a step's peak memory"
  [overhead_cpu.py]="overhead.py's loops by CPU time a step, for a loaded machine: a profile, not a claim"
  [tf_shard_memory.py]="peak memory, not time: run beside shard_memory.py"
  [shard_fsdp2.py]="torchrun's FSDP2 beside hvdtrain's stage 3: longer than make bench's 30 minutes leave room for"
  [compression_convergence.py]="hours: every method to convergence over seeds, beside torch's hook"
  [compression_hook.py]="the anchor's side of compression_convergence.py, run by it"
  [compression_sim.py]="a study of the update rules without Horovod, not a claim's benchmark"
  [hf_horovod.py]="Hugging Face GPT-2 against a plain Horovod loop: longer than make bench's 30 minutes leave room for"
  [recompute.py]="activation checkpointing on and off in both frameworks: longer than make bench's 30 minutes leave room for"
  [hf_tokenize.py]="a 100 MB corpus tokenized twice a round: longer than make bench's 30 minutes leave room for"
)
if [[ "${1:-}" == "--list" ]]; then
  for bench in "${BENCHES[@]}"; do echo "make bench: $bench"; done
  for script in $(printf '%s\n' "${!OTHERS[@]}" | sort); do echo "by hand: $script (${OTHERS[$script]})"; done
  exit 0
fi
start=$SECONDS
for bench in "${BENCHES[@]}"; do
  t0=$SECONDS
  echo "[bench] === $bench" >&2
  # shellcheck disable=SC2086  # each entry is a script and its options, split on purpose
  $PY $bench
  echo "[bench] === $bench: $((SECONDS - t0)) s" >&2
done
echo "[bench] all benchmarks: $((SECONDS - start)) s" >&2
