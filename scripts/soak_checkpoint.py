"""Checkpoint soak: kill a training run with SIGKILL at random moments while it saves, many times.

Each trial starts a writer process that runs hvdtrain's training (PyTorch, Horovod at size 1) with
a model large enough that saving takes a good part of every step and a checkpoint after every step,
waits for its third checkpoint, then kills it with SIGKILL after a random delay. The writer is
forked from this process after the imports (never after ``hvd.init``), so a trial does not pay
for importing torch again. Then it checks what a resume would see:

- the newest valid checkpoint (``CheckpointManager.latest_valid``) exists and loads
  (``torch.load(weights_only=True)``), and its step is the one its manifest names;
- a checkpoint the kill cut short (no manifest yet) or a temporary file is never taken for valid;
- after truncating the newest valid checkpoint and flipping one bit of the one before, both are
  detected and skipped, and the next older one is chosen.

Usage: python scripts/soak_checkpoint.py [--trials 20] [--seed 0] [--record docs/benchmarks.md]
Exits non-zero when any trial fails or hangs; prints one JSON line per trial and a summary.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hvdtrain.checkpoint import CheckpointManager, manifest_path, verify  # noqa: E402
from hvdtrain.config import CheckpointConfig  # noqa: E402
from hvdtrain.rundir import RunDir  # noqa: E402

# About 2.4 M parameters (19 MB with SGD momentum): saving takes much of each step.
OVERRIDES = ["model.options={hidden: [1024, 1024, 512]}", "checkpoint.every_steps=1",
             "checkpoint.keep=4", "train.epochs=50", "log.console=false", "log.wandb=disabled",
             "log.tensorboard=false", "train.threads=1"]
START_TIMEOUT_S = 300.0


def writer(run: Path) -> None:
    """The process that is killed: trains and checkpoints every step."""
    from hvdtrain.config import load_config
    from hvdtrain.driver import train

    with open(os.devnull, "w") as devnull:
        sys.stdout = sys.stderr = devnull
        train(load_config(ROOT / "configs" / "digits_torch.yaml", [*OVERRIDES, f"log.dir={run}"],
                          environ={}))


def wait_for_checkpoints(directory: Path, count: int, proc: multiprocessing.Process,
                         timeout: float) -> bool:
    """Waits until ``count`` manifests exist; False when the run ended or the time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(list(directory.glob("step-*.json"))) >= count:
            return True
        if not proc.is_alive():
            return False
        time.sleep(0.05)
    return False


def loads(path: Path) -> int:
    """Loads a checkpoint as a resume would (no code from the file) and returns its step."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    assert {"model", "optimizer", "rng", "meta"} <= set(state), sorted(state)
    return int(state["meta"]["step"])


def corrupt_and_check(manager: CheckpointManager) -> str | None:
    """Truncates the newest valid checkpoint, flips a bit of the previous: both must be skipped."""
    valid = [p for p in manager.checkpoints() if verify(p) is None]
    if len(valid) < 3:
        return f"only {len(valid)} valid checkpoints after the kill; 3 were complete before it"
    newest, second, third = valid[-1], valid[-2], valid[-3]
    newest.write_bytes(newest.read_bytes()[:-4096])
    data = bytearray(second.read_bytes())
    data[random.randrange(len(data))] ^= 1 << random.randrange(8)
    second.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = manager.latest_valid()
    if chosen != third:
        return f"after corrupting {newest.name} and {second.name}, latest_valid gave {chosen}"
    said = " ".join(str(w.message) for w in caught)
    if f"{newest.name}: size differs" not in said or f"{second.name}: sha256 differs" not in said:
        return f"corruption not reported: {said!r}"
    loads(third)
    return None


def trial(index: int, delay: float, workdir: Path) -> dict:
    """One kill-and-check trial; returns its record (``ok`` false with a ``problem`` on failure)."""
    run = workdir / f"trial-{index:03d}"
    ckpts = RunDir(run).checkpoints
    record: dict = {"trial": index, "delay_s": round(delay, 3), "ok": False}
    proc = multiprocessing.get_context("fork").Process(target=writer, args=(run,))
    proc.start()
    try:
        # Three complete checkpoints first, so that the fallback past two corrupted ones is tested.
        if not wait_for_checkpoints(ckpts, 3, proc, START_TIMEOUT_S):
            record.update(hang=proc.is_alive(), problem="no checkpoints were written")
            return record
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    manager = CheckpointManager(CheckpointConfig(keep=4), ckpts)
    files = manager.checkpoints()
    record["torn"] = sum(verify(p) is not None for p in files)  # cut short by the kill
    record["temp_files"] = len(list(ckpts.glob(".step-*.tmp")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        newest = manager.latest_valid()
    if newest is None:
        record["problem"] = "no valid checkpoint after the kill"
        return record
    step = loads(newest)
    manifest = json.loads(manifest_path(newest).read_text())
    if step != manifest["step"]:
        record["problem"] = f"{newest.name} holds step {step}, its manifest says {manifest['step']}"
        return record
    record["newest_step"] = step
    problem = corrupt_and_check(manager)
    record.update(ok=problem is None, problem=problem, fallback=problem is None)
    return record


def record_markdown(args: argparse.Namespace, summary: dict, records: list[dict]) -> None:
    """Appends the soak's result, with the command and the machine, to a Markdown file."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import harness

    machine = "; ".join(f"{k}: {v}" for k, v in harness.machine_record().items())
    delays = sorted(r["delay_s"] for r in records)
    met = summary["completed"] == summary["trials"] and summary["hangs"] == 0
    entry = harness.Entry(  # the section's row of docs/benchmarks.md's index (benchmarks/index.py)
        label="Checkpoint soak", script="scripts/soak_checkpoint.py",
        target="every trial recovers, no hang",
        verdict=f"{'met' if met else 'missed by ' + str(summary['trials'] - summary['completed'])}"
                f": {summary['completed']} of {summary['trials']} "
                f"recovered, {summary['hangs']} hangs")
    section = "\n".join([
        "## Checkpoint soak: SIGKILL while saving", "", entry.lines(),
        f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}", "", f"Commit: {harness.commit_record()}", "",
        "Reproduce (from the repository root):", "", "```",
        f".venv/bin/python scripts/soak_checkpoint.py --trials {args.trials} --seed {args.seed} "
        f"--max-delay {args.max_delay}", "```", "", f"Machine: {machine}.", "",
        "| trials | completed | hangs | killed mid-save | fallback past 2 corrupted checked |",
        "|---:|---:|---:|---:|---:|",
        f"| {summary['trials']} | {summary['completed']} | {summary['hangs']} | "
        f"{summary['killed_mid_save']} | {summary['fallback_checked']} |", "",
        "- Each trial: a run checkpointing every step (digits MLP 64-1024-1024-512-10, 19 MB "
        "checkpoints) is SIGKILLed a random delay after its third checkpoint "
        f"(uniform in 0-{args.max_delay:g} s; drawn {delays[0]:.2f}-{delays[-1]:.2f} s).",
        "- Completed: the newest valid checkpoint loaded with `torch.load(weights_only=True)` and "
        "held the step its manifest names; after truncating it and flipping one bit of the one "
        "before, `latest_valid` warned about both and chose the third newest, which loaded.",
        "- Killed mid-save: trials whose kill left a temporary file or a checkpoint without its "
        "manifest (the kill landed inside a save); neither was ever taken for valid.",
    ])
    harness.put_section(args.record, section + "\n", "# Benchmarks\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay", type=float, default=3.0,
                        help="longest wait before the kill (s)")
    parser.add_argument("--record", type=Path, help="append the result to this Markdown file")
    args = parser.parse_args(argv)
    random.seed(args.seed)
    import hvdtrain.torch.engine  # noqa: F401  (once, before the writers are forked)
    from hvdtrain.config import load_config
    from hvdtrain.driver import make_dataset

    make_dataset(load_config(None, [], environ={}))  # scikit-learn's loader, imported once too
    records = []
    with tempfile.TemporaryDirectory(prefix="hvdtrain-soak-") as tmp:
        for index in range(args.trials):
            records.append(trial(index, random.uniform(0.0, args.max_delay), Path(tmp)))
            print(json.dumps(records[-1]), flush=True)
    summary = {"trials": args.trials, "completed": sum(r["ok"] for r in records),
               "hangs": sum(bool(r.get("hang")) for r in records),
               "killed_mid_save": sum(r.get("torn", 0) > 0 or r.get("temp_files", 0) > 0
                                      for r in records),
               "fallback_checked": sum(bool(r.get("fallback")) for r in records)}
    print(json.dumps({"summary": summary}), flush=True)
    if args.record:
        record_markdown(args, summary, records)
    return 0 if summary["completed"] == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
