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
start=$SECONDS
for bench in "${BENCHES[@]}"; do
  t0=$SECONDS
  echo "[bench] === $bench" >&2
  # shellcheck disable=SC2086  # each entry is a script and its options, split on purpose
  $PY $bench
  echo "[bench] === $bench: $((SECONDS - t0)) s" >&2
done
echo "[bench] all benchmarks: $((SECONDS - start)) s" >&2
