"""Hugging Face GPT-2: hvdtrain's ``hf_causal_lm`` against a plain Horovod loop (issue 59).

A GPT-2-architecture ``transformers`` model (4 layers, width 128, made here with fresh weights and
written once with ``save_pretrained``; nothing is downloaded) is trained at ``--np`` ranks on a
corpus of this repository's docs made by ``hvdtrain data make-text --tokenizer bpe``, by
``hvdtrain train configs/hf_torch.yaml model.options.pretrained=...`` and by a plain Horovod loop
(``hf_horovod_worker.py``) that loads the same weights and trains the same windows in the same
order, with Adam, warm-up and cosine schedule alike. Two ``horovodrun`` jobs:

1. the losses: one run of each over ``--loss-steps`` steps, hvdtrain logging every step; the
   per-step losses (averaged over the ranks) are compared. Target: within :data:`LOSS_TOLERANCE`
   nats at every step (float rounding only: the same model, data and update);
2. the speed: plain (A), hvdtrain (B) and plain again (A', the A/A control) interleaved in one
   job (``harness``'s rounds), ``--steps`` steps a run, steady-state samples/s. Target: B/A at
   least :data:`TARGET`, judged where the A/A control is within :data:`TOLERANCE` of 1.

Usage (from the repository root)::

    .venv/bin/python benchmarks/hf_horovod.py
    .venv/bin/python benchmarks/hf_horovod.py --quick --no-write     # a tiny end-to-end check
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import harness
import hf_horovod_worker as worker

TARGET, TOLERANCE = 0.97, 0.01
LOSS_TOLERANCE = 1e-4
VOCAB = 4096
BASELINE, CANDIDATE, CONTROL = "plain Horovod (A)", "hvdtrain (B)", "plain Horovod (A', A/A control)"
SIZES = {"rounds": (5, 1), "steps": (60, 8), "warmup": (1, 0), "loss_steps": (20, 4)}
KEY = "steady_samples_per_s"


def spec(key: str) -> str:
    return f"hf_horovod_worker:{key}"


def prepare(work: Path) -> None:
    """The corpus (BPE of :data:`VOCAB` tokens trained on the docs) and the initial model."""
    sources = [harness.ROOT / "README.md", *sorted((harness.ROOT / "docs").glob("*.md"))]
    cli = harness.python().parent / "hvdtrain"
    subprocess.run([str(cli), "data", "make-text", *map(str, sources), "--out",
                    str(work / "corpus"), "--tokenizer", "bpe", "--vocab-size", str(VOCAB)],
                   check=True, env=harness.worker_env(), stdout=subprocess.DEVNULL)
    subprocess.run([str(harness.python()), str(harness.HERE / "hf_horovod_worker.py"),
                    str(work / "model"), str(VOCAB)], check=True, env=harness.worker_env())


def job(args: argparse.Namespace, variants: list[harness.Variant], steps: int, rounds: int,
        warmup: int) -> harness.Results:
    """One interleaved job of ``variants``, each run training ``steps`` steps."""
    job_args = copy.copy(args)
    job_args.epochs, job_args.rounds, job_args.warmup = steps, rounds, warmup
    return harness.run_interleaved(variants, job_args, KEY)


def loss_block(plain: Sequence[float], ours: Sequence[float]) -> tuple[str, float]:
    """The per-step loss table and the largest absolute difference."""
    if len(plain) != len(ours):
        raise harness.BenchError(f"losses of {len(plain)} and {len(ours)} steps")
    diffs = [abs(a - b) for a, b in zip(plain, ours, strict=True)]
    cells = [[str(i + 1), f"{a:.6f}", f"{b:.6f}", f"{d:.2e}"]
             for i, (a, b, d) in enumerate(zip(plain, ours, diffs, strict=True))]
    table = harness.markdown_grid(["step", "plain Horovod loss", "hvdtrain loss", "abs difference"],
                                  cells)
    return "Loss per step (mean over the ranks, nats):\n\n" + table, max(diffs)


def machine() -> dict[str, Any]:
    record = {"host": "2-core CI-class VM", **harness.machine_record()}
    for name in ("transformers", "tokenizers"):
        record[name] = metadata.version(name)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    """Runs both jobs, prints the section and, unless ``--no-write``, writes it."""
    p = harness.parser("hf_horovod.py", __doc__.splitlines()[0], SIZES, interleaved=True)
    args = harness.parse(p, argv)
    where = machine()
    with tempfile.TemporaryDirectory(prefix="hvdtrain-hf-bench-") as tmp:
        os.environ["HF_BENCH_DIR"] = tmp  # the workers inherit it (harness.worker_env)
        os.environ["HF_HUB_OFFLINE"] = "1"
        prepare(Path(tmp))
        harness.log("the loss job")
        losses = job(args, [harness.Variant(BASELINE, spec("plain")),
                            harness.Variant(CANDIDATE, spec("hvdtrain_losses"))],
                     args.loss_steps, 1, 0)
        harness.log("the speed job")
        variants = [harness.Variant(BASELINE, spec("plain")),
                    harness.Variant(CANDIDATE, spec("hvdtrain")),
                    harness.Variant(CONTROL, spec("plain"))]
        results = job(args, variants, args.steps, args.rounds, args.warmup)
    block, max_diff = loss_block(losses[BASELINE][0]["losses"], losses[CANDIDATE][0]["losses"])
    loss_status = "met" if max_diff <= LOSS_TOLERANCE else "missed"
    rows = harness.summarize(harness.samples_of(results, KEY), BASELINE)
    steps = harness.summarize(harness.samples_of(results, "steady_step_time_s"), BASELINE)
    named = harness.by_name(rows)
    verdict = harness.judge(named[CANDIDATE].ratio, named[CONTROL].ratio, TARGET, TOLERANCE,
                            higher_is_better=True)
    skip = worker.skip_steps(args.steps)
    loss_text = (f"loss max abs difference {max_diff:.1e} nats over the first {args.loss_steps} "
                 f"steps: {loss_status}")
    speed_text = f"samples/s {harness.brief(verdict, named[CANDIDATE])}"
    notes = [
        f"Workload: GPT-2 (`transformers` {where['transformers']}; {worker.MODEL['n_layer']} "
        f"layers, width {worker.MODEL['n_embd']}, {worker.MODEL['n_head']} heads, vocabulary "
        f"{VOCAB}, no dropout) on the docs tokenized by a BPE of {VOCAB} tokens "
        f"(`hvdtrain data make-text --tokenizer bpe`), windows of {worker.SEQ_LEN} tokens, "
        f"batch {worker.BATCH_SIZE} per rank, Adam lr {worker.LR} x {args.np}, "
        f"{worker.WARMUP} warm-up steps, cosine; both start from one `save_pretrained` "
        f"directory and train hvdtrain's sampler's windows of epoch 0 in order.",
        f"Speed: one `horovodrun -np {args.np} --{args.controller}` job, {args.steps} steps a "
        f"run, {args.rounds} rounds after {args.warmup} warm-up; steady state from the start of "
        f"step {skip + 1} to the start of the last step on rank 0 (no evaluation or checkpoint "
        f"inside); hvdtrain logs every {worker.LOG_EVERY} steps (jsonl), the plain loop keeps "
        f"its losses and averages them once after the run.",
        "Median whole-run wall time: " + ", ".join(
            f"{name} {statistics.median(m['wall_time_s'] for m in runs):.2f} s"
            for name, runs in results.items()) + " (hvdtrain's includes its final evaluation).",
        f"Losses: a job of its own, {args.loss_steps} steps, hvdtrain logging every step; "
        f"target: every step within {LOSS_TOLERANCE:g} nats. Result: {loss_text}.",
        f"Result, hvdtrain / plain samples/s: {verdict}.",
    ]
    entry = harness.Entry(
        label="Hugging Face GPT-2 vs a plain Horovod loop", script="hf_horovod.py",
        target=f"hvdtrain / plain time per sample <= {1 / TARGET:.3f} (samples/s ratio >= "
               f"{TARGET}); loss per step within {LOSS_TOLERANCE:g} nats over the first steps "
               f"(issue 59)",
        verdict=f"{speed_text}; {loss_text}",
        figure=f"time per sample ratio {1 / named[CANDIDATE].ratio:.3f} (samples/s "
               f"{named[CANDIDATE].median:.1f} against {named[BASELINE].median:.1f}, rate ratio "
               f"{named[CANDIDATE].ratio:.3f}), A/A {1 / named[CONTROL].ratio:.3f}; "
               f"loss max abs difference {max_diff:.1e} nats")
    blocks = [block,
              harness.table_block("Steady-state samples/s (higher is faster):", rows,
                                  unit="samples/s", scale=1.0, digits=1),
              harness.table_block("Steady-state step time:", steps)]
    title = "Hugging Face GPT-2: hvdtrain against a plain Horovod loop (loss and samples/s)"
    harness.publish(harness.section_text(title, args.command, where, blocks, notes, entry=entry),
                    args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
