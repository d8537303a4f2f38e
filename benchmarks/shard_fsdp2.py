"""hvdtrain ``shard.stage=3`` against PyTorch FSDP2 (``fully_shard``): samples/s and peak memory.

Issue 57's target: hvdtrain stage 3 reaches at least 0.9 x FSDP2's samples/s on the same model,
ranks and machine (FSDP2 under ``torchrun`` over Gloo), at no more than 1.1 x its peak memory.

Three jobs a round, interleaved (A B A' / A' B A): FSDP2 under ``torchrun --nproc-per-node 2``
with the ``gloo`` backend (A, the baseline), hvdtrain at ``shard.stage=3`` under ``horovodrun -np 2
--gloo`` (B), and FSDP2 again (A', the A/A control). Every job trains the built-in GPT of
``configs/lm_torch.yaml`` (widened: ``--width``, ``--layers``) on the same byte-level corpus of this
checkout's docs, the same global batches in the same order (hvdtrain's sampler), AdamW at the same
learning rate (scaled by the ranks, as hvdtrain's ``optim.scale_lr``) and weight decay, from the same
initial state dict (:class:`InitGPT`: the driver writes it once, both load it). FSDP2 is what a
PyTorch user writes: ``fully_shard`` on each layer of the ``Sequential`` (the embeddings, each
block, the head: hvdtrain's units), then on the root, at its defaults (parameters resharded after
the forward pass, implicit prefetch); the model built whole on each rank, then sharded.

Figures, on rank 0 of each job: samples/s = the global batch / the median step time over the
steps after ``--skip`` (steady state), and each rank's peak resident memory (``ru_maxrss``, as
hvdtrain's ``summary.json`` ``peak_rss_mb``). The training check: the mean global loss over each
``log.every_steps`` window (hvdtrain's ``metrics.jsonl``; FSDP2's per-step losses averaged over the
ranks after training) must agree within :data:`LOSS_TOLERANCE` over the first windows. Every job
runs with ``MALLOC_MMAP_THRESHOLD_=131072``, as ``shard_memory.py``'s, so that freed shards leave.

Usage (from the repository root)::

    .venv/bin/python benchmarks/shard_fsdp2.py --rounds 3
    .venv/bin/python benchmarks/shard_fsdp2.py --quick --no-write     # a tiny end-to-end check
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import harness

sys.path.insert(0, str(harness.ROOT))  # this checkout's hvdtrain, even where none is installed

from hvdtrain.loop import Callback
from hvdtrain.torch.lm import GPT

SIZES = {"rounds": (3, 1), "warmup": (0, 0), "steps": (30, 12), "skip": (5, 2),
         "width": (384, 64), "layers": (6, 2), "batch": (3, 2)}
KEY = "samples_per_s"
TARGET, MEMORY_TARGET = 0.9, 1.1
LOSS_TOLERANCE = 0.02
"""Relative difference allowed between the two trainings' window losses (float32 kernels add in
another order, and hvdtrain's optimizer state starts with Horovod's zero-gradient step)."""
SEED, LR, WEIGHT_DECAY, LOG_EVERY, SEQ_LEN, HEADS = 0, 3e-4, 0.01, 10, 64, 4
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}
BASELINE, CANDIDATE = "FSDP2 torchrun gloo (A)", "hvdtrain stage 3 horovodrun gloo (B)"
CONTROL = "FSDP2 torchrun gloo (A', A/A control)"


class InitGPT(GPT):
    """The built-in GPT whose layers load their initial values from a state dict of the whole
    model (``init``: its file, keys ``"<layer>.<name>"``), so that both trainers start alike.
    Each layer loads only its own entries (the file is memory-mapped), so hvdtrain's stage 3
    still builds and shards one layer at a time."""

    def __init__(self, init: str = "", **options: Any) -> None:
        self.init = init
        super().__init__(**options)

    def layers(self, spec: Any) -> list[Callable[[], Any]]:
        return [functools.partial(self._loaded, make, index)
                for index, make in enumerate(super().layers(spec))]

    def _loaded(self, make: Callable[[], Any], index: int) -> Any:
        import torch

        layer = make()
        if self.init:
            state = torch.load(self.init, mmap=True, weights_only=True)
            prefix = f"{index}."
            layer.load_state_dict({k[len(prefix):]: v for k, v in state.items()
                                   if k.startswith(prefix)})
        return layer


def model_options(args: argparse.Namespace, init: str) -> dict[str, Any]:
    """The GPT's options (``model.options``) at this run's size."""
    return {"layers": args.layers, "d_model": args.width, "heads": HEADS, "dropout": 0.0,
            "init": init}


def steady(starts: Sequence[float], skip: int, global_batch: int) -> tuple[float, float]:
    """Samples/s (the global batch over the median step) and the median step in seconds, over the
    steps after the first ``skip`` (a step's time: from its start to the next step's)."""
    steps = [b - a for a, b in zip(starts[skip:], starts[skip + 1:], strict=False)]
    if len(steps) < 3:
        raise SystemExit(f"--steps must exceed --skip + 3 (got {len(starts)} steps, skip {skip})")
    median = statistics.median(steps)
    return global_batch / median, median


def windows(losses: Sequence[float]) -> list[float]:
    """Each ``LOG_EVERY`` steps' mean loss (hvdtrain's ``metrics.jsonl`` windows)."""
    return [statistics.fmean(losses[i:i + LOG_EVERY])
            for i in range(0, len(losses) - LOG_EVERY + 1, LOG_EVERY)]


# Workers ----------------------------------------------------------------------------------------

def run_hvdtrain(args: argparse.Namespace) -> dict[str, Any]:
    """hvdtrain's trainer at ``shard.stage=3`` (under ``horovodrun``); rank 0's record."""
    with tempfile.TemporaryDirectory(prefix="hvdtrain-fsdp2-") as out:
        return _hvdtrain_in(args, out)


def _hvdtrain_in(args: argparse.Namespace, out: str) -> dict[str, Any]:
    import workload
    from hvdtrain.config import load_config
    from hvdtrain.driver import train
    from hvdtrain_worker import Clocked

    options = json.dumps(model_options(args, args.init))
    cfg = load_config(harness.ROOT / "configs" / "lm_torch.yaml", [
        f"model.name={Path(__file__).stem}:InitGPT", f"model.options={options}",
        f"data.options.root={args.corpus}", f"data.options.seq_len={SEQ_LEN}",
        f"data.batch_size={args.batch}", "data.eval_batch_size=64", "data.shuffle=true",
        f"seed={SEED}", "train.epochs=100", f"train.max_steps={args.steps}", "train.threads=0",
        "optim.name=adamw", f"optim.lr={LR}", f"optim.weight_decay={WEIGHT_DECAY}",
        "optim.scale_lr=true", "optim.warmup_steps=0", "optim.schedule=constant",
        "shard.stage=3", "checkpoint.enabled=false", "checkpoint.every_steps=0",
        f"log.every_steps={LOG_EVERY}", "log.console=false", "log.wandb=disabled",
        "log.tensorboard=false", f"log.dir={out}", "log.overwrite=true"], environ={})
    clock = workload.Clock()
    callbacks: list[Callback] = [Clocked(clock)]
    if args.profile and os.environ.get("HOROVOD_RANK") == "0":
        callbacks.append(StepProfile(args.profile, args.skip, args.steps - 1))
    result = train(cfg, callbacks=callbacks)
    engine = result.engine
    assert engine is not None, "a worker's rank trains"
    rate, median = steady(clock.step_starts, args.skip, args.batch * engine.size)
    losses, parts = [], []
    if engine.rank == 0:
        for line in (Path(out) / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if "loss" in record and record["step"] % LOG_EVERY == 0:
                losses.append(record["loss"])
                # Where a step's time went (rank 0, the window's mean): computing, and waiting
                # for the gathers and reduce-scatters.
                parts.append({k: record[k] for k in ("step_time_s", "compute_time_s",
                                                     "comm_time_s")})
    return {"rank": engine.rank, "samples_per_s": rate, "step_s": median,
            "peak_rss_mb": result.summary["peak_rss_mb"], "window_loss": losses,
            "parts_s": parts[1:] or parts, "threads": _threads()}


class StepProfile(Callback):
    """cProfile over steps ``first`` to ``last`` - 1 (steady state) of hvdtrain's loop (a
    :class:`hvdtrain.loop.Callback`); the stats go to ``path`` and the 30 costliest functions
    (own time) to stderr."""

    def __init__(self, path: str, first: int, last: int) -> None:
        import cProfile

        self.path, self.first, self.last = path, first, last
        self.profile = cProfile.Profile()

    def on_step_start(self, step: int) -> None:
        if step == self.first:
            self.profile.enable()
        elif step == self.last:
            self.profile.disable()
            import pstats

            self.profile.dump_stats(self.path)
            pstats.Stats(self.profile, stream=sys.stderr).sort_stats("tottime").print_stats(30)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def run_fsdp2(args: argparse.Namespace) -> dict[str, Any]:
    """A plain FSDP2 loop (under ``torchrun``, Gloo); rank 0's record."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import workload
    from hvdtrain.data.sampler import ShardedSampler
    from hvdtrain.data.text import TextDataset
    from hvdtrain.driver import peak_rss_mb

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(workload.threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", size))))
    torch.manual_seed(SEED + rank)
    dataset = TextDataset(args.corpus, seq_len=SEQ_LEN)
    adapter = InitGPT(**model_options(args, args.init))
    model = adapter.build(dataset.spec())
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR * size, weight_decay=WEIGHT_DECAY)
    source = dataset.train()
    plan = ShardedSampler(len(source), args.batch, seed=SEED, shuffle=True).steps(0, rank, size)
    starts, losses = [], []
    for _, indices in zip(range(args.steps), plan, strict=False):
        starts.append(time.perf_counter())
        batch = source.load(indices.micro[0])
        x, y = torch.from_numpy(np.asarray(batch.x)), torch.from_numpy(np.asarray(batch.y))
        optimizer.zero_grad()
        loss_sum, _ = adapter.loss_and_metrics(model, x, y)
        loss = loss_sum / len(x)  # the mean over this rank's sequences; FSDP2 averages the ranks
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    rate, median = steady(starts, args.skip, args.batch * size)
    mean = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean)  # after the timed steps: each step's loss averaged over the ranks
    peaks = [None] * size
    dist.all_gather_object(peaks, peak_rss_mb())
    dist.barrier()  # both ranks done with every collective; the process ends with os._exit
    return {"rank": rank, "samples_per_s": rate, "step_s": median, "peak_rss_mb": peaks,
            "window_loss": windows((mean / size).tolist()), "threads": torch.get_num_threads()}


def write_init(args: argparse.Namespace, path: Path) -> None:
    """The whole model's initial state dict, built once from :data:`SEED` (as hvdtrain's rank 0
    builds it)."""
    import torch

    from hvdtrain.data.text import TextDataset

    torch.manual_seed(SEED)
    spec = TextDataset(args.corpus, seq_len=SEQ_LEN).spec()
    model = InitGPT(**model_options(args, "")).build(spec)
    torch.save(model.state_dict(), path)
    args.params = sum(p.numel() for p in model.parameters())


# Driver -----------------------------------------------------------------------------------------

def jobs(args: argparse.Namespace) -> list[harness.Job]:
    """A, B and A'."""
    tail = ["--corpus", str(args.corpus), "--init", str(args.init), "--steps", str(args.steps),
            "--skip", str(args.skip), "--width", str(args.width), "--layers", str(args.layers),
            "--batch", str(args.batch)]
    torchrun = [str(harness.python().parent / "torchrun"), "--standalone", "--nproc-per-node=2",
                str(Path(__file__).resolve()), "--worker", "fsdp2", *tail]
    hvdtrain = [harness.horovodrun(), "-np", "2", "--gloo", str(harness.python()),
                str(Path(__file__).resolve()), "--worker", "hvdtrain", *tail]
    return [harness.Job(BASELINE, torchrun, MALLOC), harness.Job(CANDIDATE, hvdtrain, MALLOC),
            harness.Job(CONTROL, torchrun, MALLOC)]


def loss_check(results: harness.Results) -> tuple[float, str]:
    """The largest relative difference between hvdtrain's and FSDP2's window losses (same
    round), over the first two windows, and a line of the figures."""
    worst, shown = 0.0, []
    for ours, theirs in zip(results[CANDIDATE], results[BASELINE], strict=True):
        pairs = list(zip(ours["window_loss"][:2], theirs["window_loss"][:2], strict=False))
        if not pairs:
            raise harness.BenchError("no window losses to compare: --steps below log.every_steps")
        worst = max(worst, *(abs(a - b) / abs(b) for a, b in pairs))
        shown.append(" / ".join(f"{a:.4f} vs {b:.4f}" for a, b in pairs))
    return worst, "; ".join(shown)


def memory_rows(results: harness.Results) -> tuple[harness.Row, harness.Row]:
    """hvdtrain's and the control's peak RSS (the larger rank's per run) against FSDP2's."""
    peaks = {name: [max(r["peak_rss_mb"]) for r in runs] for name, runs in results.items()}
    rows = harness.by_name(harness.summarize(peaks, BASELINE))
    return rows[CANDIDATE], rows[CONTROL]


def memory_status(verdict: harness.Verdict) -> str:
    """The memory verdict's status, a miss with its distance to the target."""
    if verdict.status == "missed":
        return f"missed by {verdict.ratio - verdict.target:.3f}"
    return verdict.status


def rows_mb(results: harness.Results, name: str) -> float:
    """The median over runs of the larger rank's peak RSS, MiB."""
    return statistics.median(max(r["peak_rss_mb"]) for r in results[name])


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the rounds, prints the section and, unless ``--no-write``, writes it."""
    p = harness.parser("shard_fsdp2.py", __doc__.splitlines()[0], SIZES, timeout=900.0)
    args = harness.parse(p, argv)
    machine = harness.machine_record()
    from shard_memory import corpus

    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-fsdp2-") as tmp:
        args.corpus = corpus(Path(tmp))
        args.init = Path(tmp) / "init.pt"
        write_init(args, args.init)
        results = harness.run_jobs(jobs(args), args.rounds, args.warmup, KEY, args.timeout)
    rows = harness.summarize(harness.samples_of(results, KEY), BASELINE)
    named = harness.by_name(rows)
    verdict = harness.judge(named[CANDIDATE].ratio, named[CONTROL].ratio, TARGET,
                            higher_is_better=True)
    mem, mem_control = memory_rows(results)
    mem_verdict = harness.judge(mem.ratio, mem_control.ratio, MEMORY_TARGET)
    worst, losses = loss_check(results)
    agree = "agree" if worst <= LOSS_TOLERANCE else "DISAGREE"
    peaks = "; ".join(f"{name.split(' (')[0]}{' (A/A)' if name == CONTROL else ''} "
                      + ", ".join("/".join(f"{v:.0f}" for v in r["peak_rss_mb"]) for r in runs)
                      for name, runs in results.items())
    steps_ms = "; ".join(f"{name.split(' (')[0]}{' (A/A)' if name == CONTROL else ''} "
                         + ", ".join(f"{r['step_s'] * 1e3:.0f}" for r in runs)
                         for name, runs in results.items())
    notes = [
        f"Workload: the built-in GPT, {args.layers} blocks of width {args.width}, {HEADS} heads, "
        f"{args.params / 1e6:.1f} M parameters; {args.batch} sequences of {SEQ_LEN} bytes a rank "
        f"(docs corpus); AdamW lr {LR} x ranks, weight decay {WEIGHT_DECAY}; {args.steps} steps "
        f"a job, median step over steps {args.skip + 1} to {args.steps}; {args.rounds} rounds "
        f"after {args.warmup} warm-up; 2 ranks; MALLOC_MMAP_THRESHOLD_=131072 for every job.",
        f"Speed, hvdtrain stage 3 / FSDP2: {verdict}.",
        f"Peak RSS, the larger rank's, hvdtrain / FSDP2: {mem.ratio:.3f} (interval "
        f"{mem.low:.3f}-{mem.high:.3f}), A/A {mem_control.ratio:.3f}: {memory_status(mem_verdict)} "
        f"(target <= {MEMORY_TARGET}). Per run, rank 0/rank 1 MiB: {peaks}.",
        f"Median step, ms, per run: {steps_ms}.",
        f"Training check, mean loss of steps 1-{LOG_EVERY} / {LOG_EVERY + 1}-{2 * LOG_EVERY}, "
        f"hvdtrain vs FSDP2 per round: {losses}; largest relative difference {worst:.2e} "
        f"({agree} within {LOSS_TOLERANCE}).",
    ]
    fmt = {"unit": "samples/s", "scale": 1.0, "digits": 2}
    entry = harness.Entry(
        label="Sharded data parallel, stage 3 vs FSDP2", script="shard_fsdp2.py",
        target=f"hvdtrain stage 3 / FSDP2 time per sample <= {1 / TARGET:.3g}, peak memory <= "
               f"{MEMORY_TARGET}",
        figure=f"samples/s hvdtrain {named[CANDIDATE].median:.2f}, FSDP2 "
               f"{named[BASELINE].median:.2f}; peak RSS per rank {mem.median:.0f} vs "
               f"{rows_mb(results, BASELINE):.0f} MiB",
        verdict=f"speed {harness.brief(verdict, named[CANDIDATE])}; memory "
                f"{memory_status(mem_verdict)}: {mem.ratio:.3f} (interval {mem.low:.3f}-"
                f"{mem.high:.3f}), "
                f"A/A {mem_control.ratio:.3f}; losses {agree} ({worst:.1e}); {args.rounds} rounds")
    harness.publish(harness.section_text(
        "Sharded data parallel: hvdtrain stage 3 against FSDP2, samples/s and peak memory",
        args.command, machine, [harness.table_block("", rows, **fmt)], notes, entry=entry), args)
    return 0


def worker_args(argv: Sequence[str]) -> argparse.Namespace:
    """A worker's options (the driver passes them)."""
    p = argparse.ArgumentParser()
    p.add_argument("--worker", choices=("hvdtrain", "fsdp2"), required=True)
    p.add_argument("--corpus", required=True)
    p.add_argument("--init", required=True)
    for name in ("steps", "skip", "width", "layers", "batch"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--profile", default="",
                   help="hvdtrain: cProfile rank 0's steady steps, stats written here")
    return p.parse_args(argv)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        wargs = worker_args(sys.argv[1:])
        record = run_hvdtrain(wargs) if wargs.worker == "hvdtrain" else run_fsdp2(wargs)
        if record["rank"] == 0:
            print(json.dumps({**record, "trainer": wargs.worker}), flush=True)
        if wargs.worker == "fsdp2":
            # Gloo's teardown in torch 2.13 aborted one rank of a finished job now and then
            # ("terminate called without an active exception", after its record): the work is
            # done and flushed, so the process ends without running destructors.
            sys.stderr.flush()
            os._exit(0)
        sys.exit(0)
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    sys.exit(main())
