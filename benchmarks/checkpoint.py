"""Checkpoint save: hvdtrain's save against a plain write of the same state.

One process (Horovod at size 1) builds the PyTorch engine for an MLP of a few million parameters,
trains it one step (so that the optimizer holds momentum), then saves in rounds:

- A: ``engine.state_bytes`` written to a plain file: no temporary file, fsync, hash or manifest;
- B: ``CheckpointManager.save`` as the loop calls it: what the step waits for (the state
  serialised; write, fsync, rename, sha256 and manifest go on in a thread);
- C: ``CheckpointManager.save`` then ``wait()``: until checkpoint and manifest are durable;
- A': A again, the A/A control.

B's background write is waited for, untimed, before the next save. Target: B/A at most 1.2.

Usage (from the repository root)::

    .venv/bin/python benchmarks/checkpoint.py
    .venv/bin/python benchmarks/checkpoint.py --quick --no-write   # a tiny end-to-end check
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import harness

sys.path.insert(0, str(harness.ROOT))  # this checkout's hvdtrain, even where none is installed

NAMES = ("plain write (A)", "hvdtrain save, step waits (B)", "hvdtrain save, until durable (C)",
         "plain write (A', A/A control)")
TARGET = 1.2
SIZES = {"rounds": (30, 2), "warmup": (2, 0)}


def build_engine(hidden: str) -> tuple[Any, Any]:
    """The config and a PyTorch engine on digits with a wide MLP, after one training step."""
    from hvdtrain.config import load_config
    from hvdtrain.data.sampler import ShardedSampler
    from hvdtrain.driver import make_dataset
    from hvdtrain.engine import make_engine

    cfg = load_config(harness.ROOT / "configs" / "digits_torch.yaml",
                      [f"model.options={{hidden: [{hidden}]}}"], environ={})
    dataset = make_dataset(cfg)
    engine = make_engine(cfg, dataset)
    engine.broadcast_state()
    sampler = ShardedSampler(len(dataset.train()), cfg.data.batch_size)
    engine.train_step(next(iter(sampler.steps(0, 0, 1))), cfg.optim.lr)
    return cfg, engine


def measure(rounds: int, warmup: int, hidden: str) -> tuple[dict[str, list[float]], int]:
    """Seconds per save of each variant, and the checkpoint's size in bytes."""
    from hvdtrain.checkpoint import CheckpointManager, verify
    from hvdtrain.rundir import RunDir

    cfg, engine = build_engine(hidden)
    meta = {"position": {"step": 1}, "framework": "torch", "config": cfg.to_dict()}
    samples: dict[str, list[float]] = {name: [] for name in NAMES}
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-ckpt-", dir=harness.ROOT) as tmp:
        manager = CheckpointManager(cfg.checkpoint, RunDir(tmp).checkpoints)
        plain = Path(tmp) / "plain.ckpt"
        step = 0
        for index in range(-warmup, rounds):
            for slot in harness.round_order(range(len(NAMES)), index):
                step += 1
                tick = time.perf_counter()
                if slot in (1, 2):
                    manager.save(engine, 0, step, meta)
                    if slot == 2:
                        manager.wait()
                else:
                    plain.write_bytes(engine.state_bytes({**meta, "step": step}))
                seconds = time.perf_counter() - tick
                manager.wait()  # B's write finishes before anything else is timed
                if index >= 0:
                    samples[NAMES[slot]].append(seconds)
        newest = manager.latest_valid()
        if newest is None or verify(newest):
            raise harness.BenchError("the newest checkpoint does not verify")
        return samples, plain.stat().st_size


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the rounds, prints the section and, unless ``--no-write``, writes it."""
    p = harness.parser("checkpoint.py", __doc__.splitlines()[0], SIZES)
    p.add_argument("--hidden", default="2048,2048", help="MLP hidden sizes, comma-separated")
    args = harness.parse(p, argv)
    machine = harness.machine_record()
    samples, size = measure(args.rounds, args.warmup, args.hidden)
    rows = harness.summarize(samples, NAMES[0])
    named = harness.by_name(rows)
    verdict = harness.judge(named[NAMES[1]].ratio, named[NAMES[3]].ratio, TARGET)
    notes = [
        f"State: digits MLP 64-{args.hidden.replace(',', '-')}-10 with SGD momentum, one step "
        f"trained; checkpoint {size / 1e6:.1f} MB (model, optimizer, RNG states, meta with the "
        "resolved config), written to the repository's disk.",
        "C adds to B the write with the sha256 on the way, flush, fsync, rename, fsync of the "
        "directory and the manifest: the checkpoint is durable.",
        f"Result, a step's wait / plain write: {verdict}; durable / plain write = "
        f"{named[NAMES[2]].ratio:.3f}.",
    ]
    entry = harness.Entry(
        label="Checkpoint save", script="checkpoint.py",
        target=f"the step's wait / `torch.save` <= {TARGET}",
        verdict=f"{harness.brief(verdict, named[NAMES[1]])}; durable / plain write "
                f"{named[NAMES[2]].ratio:.3f}")
    harness.publish(harness.section_text(
        "Checkpoint save: hvdtrain vs plain torch.save (seconds per save)", args.command, machine,
        [harness.table_block("", rows, digits=1)], notes, entry=entry), args)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    sys.exit(main())
