"""Where a sharded run's peak resident memory is: each phase of a step's peak (the profile behind
the "Sharded data parallel, peak memory per rank" section of docs/benchmarks.md).

Under ``horovodrun`` every rank trains the built-in GPT as ``shard_memory.py`` does, while a
thread samples the process's resident memory every millisecond and the phase it is in (the
engine's build and broadcast, the zero-gradient warm-up, each step's zero_grad, forward,
backward, exchange, optimizer step and all-gather, evaluation), set by wrapping those methods
from outside the product. Each rank prints one JSON line: its peak, the phase that reached it,
and every phase's highest sample. ``--census`` also counts the live torch tensors (bytes by
shape, one storage counted once) at the end of each backward pass and before each optimizer
step, found through the garbage collector.

Usage (from the repository root)::

    horovodrun -np 4 --gloo .venv/bin/python benchmarks/shard_memory_profile.py \
        --stage 3 --width 1024 --layers 12
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 2**20


def rss() -> int:
    """The process's resident bytes now."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE


class Sampler:
    """Samples the resident memory every ``every_s`` seconds with the phase set last."""

    def __init__(self, every_s: float = 0.001) -> None:
        self.phase, self.every_s = "start", every_s
        self.peaks: dict[str, int] = {}
        self.order: list[str] = []
        self.top = (0, "start")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def set(self, phase: str) -> None:
        self.sample()
        self.phase = phase
        if phase not in self.peaks:
            self.order.append(phase)

    def sample(self) -> None:
        now, phase = rss(), self.phase
        if now > self.peaks.get(phase, 0):
            self.peaks[phase] = now
        if now > self.top[0]:
            self.top = (now, phase)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.every_s)


def census(label: str, out: list[dict[str, Any]]) -> None:
    """The live tensors' storages by dtype and shape (each storage once), largest first."""
    import torch

    seen: set[int] = set()
    sizes: dict[str, int] = {}
    for obj in gc.get_objects():
        try:
            if not torch.is_tensor(obj):
                continue
            storage = obj.untyped_storage()
        except Exception:  # noqa: BLE001 - a half-built object
            continue
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes or ptr in seen:
            continue
        seen.add(ptr)
        key = f"{type(obj).__name__} {str(obj.dtype)[6:]} {nbytes // 4}"
        sizes[key] = sizes.get(key, 0) + nbytes
    top = sorted(sizes.items(), key=lambda kv: -kv[1])[:12]
    out.append({"at": label, "total_mib": round(sum(sizes.values()) / MIB, 1),
                "rss_mib": round(rss() / MIB, 1),
                "largest": [[k, round(v / MIB, 1)] for k, v in top]})


def wrap(owner: Any, name: str, phase: Callable[[], str], sampler: Sampler,
         after: str | None = None, hook: Callable[[], None] | None = None) -> None:
    """``owner.name`` sets ``phase()`` while it runs (then ``after``, else the phase before)."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        before = sampler.phase
        sampler.set(phase())
        try:
            return original(*args, **kwargs)
        finally:
            if hook is not None:
                hook()
            sampler.set(after if after is not None else before)

    setattr(owner, name, wrapped)


def instrument(sampler: Sampler, censuses: list[dict[str, Any]] | None) -> None:
    """Wraps the phases of a run (module docstring) from outside the product."""
    import torch

    import hvdtrain.step as step
    from hvdtrain.torch import engine, precision, shard, shard_units
    from hvdtrain.torch import step as torch_step

    count = {"step": 0}

    def at(name: str) -> Callable[[], str]:
        return lambda: f"{count['step']}:{name}"

    def next_step() -> str:
        count["step"] += 1
        return f"{count['step']}:zero_grad"

    def take(label: str) -> Callable[[], None] | None:
        if censuses is None:
            return None
        return lambda: census(f"{count['step']}:{label}", censuses)

    wrap(engine.TorchEngine, "__init__", lambda: "build", sampler, after="idle")
    wrap(engine.TorchEngine, "broadcast_state", lambda: "broadcast", sampler, after="idle")
    wrap(engine.TorchEngine, "evaluate", lambda: "evaluate", sampler, after="idle")
    wrap(torch_step.TorchKernels, "begin", next_step, sampler, after="?")
    wrap(torch_step.TorchKernels, "backward", at("forward+backward"), sampler,
         after="?", hook=take("after backward"))
    wrap(precision.Precision, "backward", at("backward"), sampler)
    wrap(torch_step.TorchKernels, "gradients", at("settle"), sampler)
    wrap(step, "exchange_and_update", at("exchange"), sampler, after="idle")
    wrap(precision.Precision, "update", at("update"), sampler)
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        wrap(cls, "step", at("adam"), sampler)
    wrap(shard.ShardedOptimizer, "step", at("sharded step"), sampler,
         hook=None)
    wrap(shard.ShardedOptimizer, "_load_shard", at("load shard"), sampler,
         hook=take("before adam"))
    wrap(shard.ShardedOptimizer, "allgather", at("allgather"), sampler)
    wrap(shard.ShardedOptimizer, "reducescatter", at("reducescatter"), sampler)
    wrap(shard_units.UnitSharding, "load_shards", at("load shards"), sampler,
         hook=take("before adam"))
    wrap(shard_units.UnitSharding, "after_step", at("allgather"), sampler)
    wrap(shard_units.UnitSharding, "settle", at("settle"), sampler)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--census", action="store_true")
    p.add_argument("overrides", nargs="*", help="further key=value config overrides")
    args = p.parse_args(argv)

    from hvdtrain.config import load_config
    from hvdtrain.data.text import make_text
    from hvdtrain.driver import train

    root = Path(__file__).resolve().parent.parent
    sampler = Sampler()
    censuses: list[dict[str, Any]] | None = [] if args.census else None
    instrument(sampler, censuses)
    with tempfile.TemporaryDirectory(prefix="hvdtrain-shardmem-profile-") as tmp:
        text = Path(tmp) / "docs"
        rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
        # Every rank makes its own copy of the corpus (no rank waits for another's).
        source = Path(tmp) / f"docs-source-{rank}.md"
        files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
        source.write_bytes(b"".join(f.read_bytes() + b"\n" for f in files))
        make_text([source], text, val_fraction=0.01)
        cfg = load_config(root / "configs" / "lm_torch.yaml", [
            f"data.options.root={text}", f"model.options.d_model={args.width}",
            f"model.options.layers={args.layers}", "model.options.heads=4", "data.batch_size=2",
            "data.eval_batch_size=8", f"train.max_steps={args.steps}", "optim.warmup_steps=0",
            "checkpoint.enabled=false", "checkpoint.every_steps=0", "log.console=false",
            "log.wandb=disabled", "log.tensorboard=false", f"log.dir={tmp}/run",
            "log.overwrite=true", f"shard.stage={args.stage}", *args.overrides], environ={})
        sampler.start()
        result = train(cfg)
        sampler.stop()
    engine = result.engine
    assert engine is not None
    print(json.dumps({
        "rank": engine.rank, "stage": args.stage, "size": engine.size,
        "peak_mib": round(sampler.top[0] / MIB, 1), "peak_phase": sampler.top[1],
        "ru_maxrss_mib": result.summary["peak_rss_mb"][engine.rank],
        "phases": {k: round(sampler.peaks[k] / MIB, 1) for k in sampler.order
                   if k in sampler.peaks},
        "census": censuses}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
