"""Input pipelines: images from disk with workers vs preloaded in memory; memory vs data set size.

Loading (one section per framework): ResNet-18 (narrow: ``--width``) on 64x64 JPEGs written by
``hvdtrain data make-images``, four variants interleaved in one ``horovodrun -np 2`` job
(``data_worker.VARIANTS``): the images decoded once and preloaded in memory (A, and the A/A
control A'), read from disk by ``image_folder`` with the default loader workers (B), and with
none (C, loading on the training thread). No augmentation, so the four train on the same
numbers. Targets: B/A samples/s >= 0.95, judged where the A/A control is within 5% of 1, and
B's ``data_wait_time_s`` under 5% of its step time (from ``metrics.jsonl``); C against B shows
what parallel loading buys.

Memory (one section per framework): the same training work on an ``npy`` data set (uint8 pixels,
memory-mapped, default workers) of ``--small`` samples for ten epochs (A, A') and of ten times
as many for one (B), so that only the data set's size differs; each run is a ``horovodrun`` job of
its own, since a peak covers a process's life. Target: the worst rank's peak resident set B/A <=
1.10, judged where the A/A control is within 10% of 1; the peaks of a rank with its loader
workers, all memory and anonymous only, beside it.

Usage (from the repository root)::

    .venv/bin/python benchmarks/data.py
    .venv/bin/python benchmarks/data.py --quick --no-write   # a tiny end-to-end check
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import workload

MEMORY, DISK, DISK0, CONTROL = ("in memory (A)", "disk, default workers (B)",
                                "disk, workers 0 (C)", "in memory (A', A/A control)")
SMALL, LARGE, SMALL_CONTROL = "npy N (A)", "npy 10 N (B)", "npy N (A', A/A control)"
SPEED_TARGET, SPEED_TOLERANCE = 0.95, 0.05
WAIT_TARGET = 0.05
MEMORY_TARGET, MEMORY_TOLERANCE = 1.10, 0.10
FACTOR = 10
"""How much larger the large ``npy`` set is; the small one is trained as many epochs."""
FRAMEWORKS = {"torch": ("PyTorch", "torch"), "tensorflow": ("TensorFlow", "tf")}
PARTS = ("loading", "memory")
SIZES = {"rounds": (3, 1), "warmup": (1, 0), "epochs": (2, 2), "train": (2000, 64),
         "test": (200, 32), "width": (16, 8), "small": (2000, 200)}
MEMORY_KEYS = (("rank_rss_mb", "Peak resident set of the worst rank (`ru_maxrss`)"),
               ("tree_pss_mb", "Peak proportional set of a rank with its loader workers "
                               "(sampled every 0.2 s; mapped file pages included)"),
               ("tree_anon_mb", "Peak anonymous memory of a rank with its loader workers "
                                "(sampled; memory no file backs)"))
SHAPE = (3, 64, 64)
"""One sample of the ``npy`` sets: uint8 pixels, channels first."""


def loading_variants(framework: str) -> list[harness.Variant]:
    """A, B, C and A': keys of ``data_worker.VARIANTS``."""
    short = FRAMEWORKS[framework][1]
    return [harness.Variant(MEMORY, f"data_worker:memory_{short}"),
            harness.Variant(DISK, f"data_worker:disk_{short}"),
            harness.Variant(DISK0, f"data_worker:disk0_{short}"),
            harness.Variant(CONTROL, f"data_worker:memory_{short}")]


def speed_verdict(rows: Sequence[harness.Row]) -> harness.Verdict:
    """Disk with workers / in memory, judged beside the A/A control."""
    named = harness.by_name(rows)
    return harness.judge(named[DISK].ratio, named[CONTROL].ratio, SPEED_TARGET, SPEED_TOLERANCE,
                         higher_is_better=True)


def workers_gain(samples: dict[str, list[float]]) -> tuple[float, float, float]:
    """Default workers / workers 0 (samples/s): the ratio of medians and its 95% interval."""
    ratio = statistics.median(samples[DISK]) / statistics.median(samples[DISK0])
    low, high = harness.ratio_interval(samples[DISK0], samples[DISK])
    return ratio, low, high


def wait_shares(results: harness.Results, key: str = "data_wait_share") -> dict[str, list[float]]:
    """Each variant's shares of step time spent waiting for data (runs without one left out)."""
    return {name: [float(run[key]) for run in runs if run.get(key) is not None]
            for name, runs in results.items()}


def wait_table(shares: dict[str, list[float]]) -> str:
    """Min, median and max of each variant's wait share, in percent."""
    stats = (min, statistics.median, max)
    cells = [[name, str(len(values)), *(f"{100 * f(values):.2f}" for f in stats)]
             for name, values in shares.items() if values]
    return harness.markdown_grid(["name", "runs", "min (%)", "median (%)", "max (%)"], cells)


@dataclass(frozen=True)
class WaitVerdict:
    """A median share of step time spent waiting for data, judged against a ceiling."""

    status: str
    """``met`` (the share is under the target) or ``missed``."""
    share: float
    target: float

    def __str__(self) -> str:
        return (f"{100 * self.share:.2f}% of step time: {self.status} "
                f"(target < {100 * self.target:.0f}%)")


def wait_verdict(shares: dict[str, list[float]]) -> WaitVerdict:
    """B's median wait share against :data:`WAIT_TARGET`."""
    median = statistics.median(shares[DISK])
    return WaitVerdict("met" if median < WAIT_TARGET else "missed", median, WAIT_TARGET)


def memory_verdicts(tables: dict[str, list[harness.Row]]) -> dict[str, harness.Verdict]:
    """10 N / N of each memory figure, judged beside its A/A control."""
    verdicts = {}
    for key, rows in tables.items():
        named = harness.by_name(rows)
        verdicts[key] = harness.judge(named[LARGE].ratio, named[SMALL_CONTROL].ratio,
                                      MEMORY_TARGET, MEMORY_TOLERANCE)
    return verdicts


def make_images(root: Path, train: int, test: int) -> None:
    """The JPEGs of the loading benchmark (``hvdtrain data make-images``)."""
    sys.path.insert(0, str(harness.ROOT))
    from hvdtrain.data.make_images import make_images as write

    write(root, train, test, SHAPE[1])


def write_npy(root: Path, samples: int, test: int, seed: int = 0) -> None:
    """An ``npy`` data set of ``samples`` random uint8 training images and ``test`` test ones,
    written a chunk at a time (never whole in this process's memory)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", samples), ("test", test)):
        x = np.lib.format.open_memmap(root / f"{split}_x.npy", "w+", np.uint8, (count, *SHAPE))
        for start in range(0, count, 1000):
            stop = min(count, start + 1000)
            x[start:stop] = rng.integers(0, 256, (stop - start, *SHAPE), np.uint8)
        x.flush()
        del x
        np.save(root / f"{split}_y.npy", rng.integers(0, 10, count).astype(np.int64))


def loading_section(framework: str, args: argparse.Namespace, work: Path) -> str:
    """Runs the loading variants of ``framework`` interleaved; the section."""
    root = work / "images"
    if not root.exists():
        harness.log(f"writing {args.train} + {args.test} JPEGs to {root}")
        make_images(root, args.train, args.test)
    os.environ.update(BENCH_DATA_ROOT=str(root), BENCH_DATA_WIDTH=str(args.width))
    keys = ("samples_per_s", "steady_samples_per_s")
    machine, results, (whole, steady) = harness.measure(loading_variants(framework), args, keys)
    shares = wait_shares(results)
    ratio, low, high = workers_gain(harness.samples_of(results, "steady_samples_per_s"))
    fmt: dict[str, Any] = {"unit": "samples/s", "scale": 1.0, "digits": 1}
    blocks = [harness.table_block("Whole run (samples / training wall time):", whole, **fmt),
              harness.table_block(f"Steady state ({workload.STEADY_SPAN}):", steady, **fmt),
              "Share of step time waiting for data (`data_wait_time_s` / `step_time_s` of "
              "`metrics.jsonl`, epochs 2 to N):\n\n" + wait_table(shares)]
    steps = next(iter(results.values()))[0]["steps"]
    notes = [
        f"Workload: ResNet-18 of width {args.width} (`model.options.width`) on {args.train} "
        f"training and {args.test} test JPEGs of {SHAPE[1]}x{SHAPE[2]} pixels (`hvdtrain data "
        f"make-images`), batch {workload.BATCH_SIZE} per rank, `configs/images_"
        f"{'tf' if framework == 'tensorflow' else 'torch'}.yaml` without augmentation, all runs "
        f"in one `horovodrun -np {args.np} --{args.controller}` job; {args.epochs} epochs "
        f"({steps} steps) a run; {args.rounds} rounds after {args.warmup} warm-up.",
        "In memory: `data_worker.PreloadedImages`, the same JPEGs decoded once by "
        "`image_folder`'s decoder into an in-memory `Split` (gathered on the training thread); "
        "disk: `image_folder` decoding in the loader (default `data.workers: -1`, one worker a "
        "rank here; workers 0: on the training thread).",
        "Timed through a `hvdtrain.loop.Callback` (steady state) and `summary.json` (whole run); "
        "the wait share from the run's `metrics.jsonl`.",
        f"Result, disk with workers / in memory, whole run: {speed_verdict(whole)}.",
        f"Result, disk with workers / in memory, steady state: {speed_verdict(steady)}.",
        f"Result, data wait of disk with workers: {wait_verdict(shares)}.",
        f"Parallel loading, default workers / workers 0, steady samples/s: {ratio:.3f} (95% "
        f"interval {low:.3f}-{high:.3f}).",
    ]
    if args.np >= (os.cpu_count() or 1):
        notes.insert(3, f"{args.np} ranks on {os.cpu_count()} cores: a loader worker decodes on "
                     "the cores that train, so parallel loading can hide the wait for data but "
                     "adds no CPU; disk against memory then weighs decoding's CPU cost against "
                     "the model's.")
    name = FRAMEWORKS[framework][0]
    title = (f"Input pipeline, {name}: ResNet-18 on 64x64 JPEGs from disk vs preloaded in memory "
             "(samples/s)")
    disk_whole, disk_steady = harness.by_name(whole)[DISK], harness.by_name(steady)[DISK]
    wait = wait_verdict(shares)
    wait_status = (wait.status if wait.status != "missed"
                   else f"missed by {100 * (wait.share - wait.target):.2f}%")
    entry = harness.Entry(
        label=f"Input pipeline, {name}", script="data.py --parts loading",
        target=f"disk with workers / in memory time per sample <= {1 / SPEED_TARGET:.3f}; data wait < "
               f"{100 * WAIT_TARGET:.0f}% of step time",
        verdict=f"ResNet-18 width {args.width}, {args.train} images: whole run "
                f"{harness.brief(speed_verdict(whole), disk_whole)}; steady state "
                f"{harness.brief(speed_verdict(steady), disk_steady)}; data wait "
                f"{wait_status}: {100 * wait.share:.2f}%")
    return harness.section_text(title, args.command, machine, blocks, notes, entry=entry)


def npy_test_count(args: argparse.Namespace) -> int:
    """The test split of both ``npy`` sets: a tenth of the small one's training split (the same
    in both, so that the evaluation's batches do not differ)."""
    return max(1, args.small // 10)


def memory_jobs(framework: str, args: argparse.Namespace, work: Path) -> list[harness.Job]:
    """A, B and A': a ``horovodrun`` job each over the small or the large ``npy`` set."""
    jobs = []
    sets = ((SMALL, args.small, FACTOR), (LARGE, FACTOR * args.small, 1),
            (SMALL_CONTROL, args.small, FACTOR))
    for name, samples, epochs in sets:
        root = work / f"npy-{samples}"
        if not root.exists():
            harness.log(f"writing an npy data set of {samples} samples to {root}")
            write_npy(root, samples, npy_test_count(args))
        argv = [harness.horovodrun(), "-np", str(args.np), f"--{args.controller}",
                str(harness.python()), str(harness.HERE / "data_worker.py"), "--framework",
                framework, "--root", str(root), "--epochs", str(epochs), "--out-dir",
                str(work / f"run-{len(jobs)}")]
        jobs.append(harness.Job(name, argv, {}))
    return jobs


def memory_section(framework: str, args: argparse.Namespace, work: Path) -> str:
    """Runs the memory jobs of ``framework`` in rounds; the section."""
    machine = harness.machine_record()
    results = harness.run_jobs(memory_jobs(framework, args, work), args.memory_rounds, 0,
                               MEMORY_KEYS[0][0], args.timeout)
    tables = {key: harness.summarize(harness.samples_of(results, key), SMALL)
              for key, _ in MEMORY_KEYS}
    verdicts = memory_verdicts(tables)
    blocks = [harness.table_block(f"{caption}:", tables[key], unit="MB", scale=1.0, digits=1)
              for key, caption in MEMORY_KEYS]
    size_mb = args.small * (SHAPE[0] * SHAPE[1] * SHAPE[2] + 8) / 1e6
    notes = [
        f"Workload: an MLP (hidden 64) trained on {FACTOR * args.small} samples, batch 64 per "
        f"rank: {FACTOR} epochs of an `npy` data set of {args.small} (N) or one epoch of "
        f"{FACTOR * args.small} (10 N) random uint8 images of {'x'.join(map(str, SHAPE))} "
        f"({size_mb:.0f} MB or {FACTOR * size_mb:.0f} MB on disk), and the same "
        f"{npy_test_count(args)} test images (evaluated once, at the end), "
        f"`data.workers: -1` (one worker a rank), {FRAMEWORKS[framework][0]}, "
        f"`horovodrun -np {args.np} --{args.controller}`, a job a run; {args.memory_rounds} "
        "rounds.",
        "Each rank samples itself and its child processes (`/proc/PID/smaps_rollup`) in a thread; "
        "the job's figure is the largest over its ranks (gathered by the engine's "
        "`allgather_object` after `hvdtrain.driver.train`).",
        "Resident and proportional sets count the pages of the memory-mapped files that a "
        "process has touched or the kernel mapped around them (page cache, which the kernel can "
        "reclaim); anonymous memory leaves them out.",
        *(f"Result, 10 N / N, {key}: {verdict}." for key, verdict in verdicts.items()),
    ]
    name = FRAMEWORKS[framework][0]
    title = f"Input pipeline memory, {name}: npy data set 10x larger (peak MB)"
    entry = harness.Entry(
        label=f"Input pipeline memory, {name}", script="data.py --parts memory",
        target=f"peak memory of a rank, {FACTOR}x larger npy set / smaller <= {MEMORY_TARGET:.2f}",
        verdict="; ".join(f"{key} {harness.brief(v, harness.by_name(tables[key])[LARGE])}"
                          for key, v in verdicts.items()))
    return harness.section_text(title, args.command, machine, blocks, notes, entry=entry)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the chosen parts for each framework, printing and (unless ``--no-write``) writing
    each section as it finishes."""
    p = harness.parser("data.py", __doc__.splitlines()[0], SIZES, interleaved=True,
                       timeout=3600.0)
    p.add_argument("--frameworks", default="torch,tensorflow", help="comma-separated")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated: loading, memory")
    p.add_argument("--memory-rounds", type=int, default=2,
                   help="rounds of the memory jobs, after no warm-up (default 2; --quick: 1)")
    args = harness.parse(p, argv)
    if args.quick:
        args.memory_rounds = 1
    frameworks, parts = args.frameworks.split(","), args.parts.split(",")
    if not set(frameworks) <= set(FRAMEWORKS) or not set(parts) <= set(PARTS):
        p.error(f"--frameworks takes {', '.join(FRAMEWORKS)}; --parts {', '.join(PARTS)}")
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-data-") as tmp:
        for part in parts:
            for framework in frameworks:
                section = (loading_section if part == "loading" else memory_section)
                harness.publish(section(framework, args, Path(tmp)), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
