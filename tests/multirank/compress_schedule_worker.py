"""The compressing exchange's step schedule at 2 ranks, under horovodrun, with the framework's own
kernels and Horovod's collectives: the dense start (``comm.dense_steps``) and the adaptive switch
(``comm.adaptive``). Each rank writes OUT/<run>.rank<r>.json: per step whether the exchange's
average equals Horovod's own dense average of the same gradients (what ``none`` sends), the wire
and dense bytes, the adaptive level before the step and a digest of the average (ranks compare).

Usage (under horovodrun -np 2): compress_schedule_worker.py torch|tensorflow OUT_DIR
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain.config import CommConfig

SHAPES = [(64, 48), (48,), (48, 10)]
STEPS, DENSE, INTERVAL = 12, 2, 3
RUNS = {
    "dense_topk": CommConfig(compression="topk", ratio=0.05, min_size=0, dense_steps=DENSE),
    "dense_powersgd": CommConfig(compression="powersgd", rank=1, min_size=0, dense_steps=DENSE),
    "adaptive_topk": CommConfig(compression="topk", ratio=0.05, min_size=0, adaptive=True,
                                adaptive_interval=INTERVAL),
    "adaptive_powersgd": CommConfig(compression="powersgd", rank=1, min_size=0, adaptive=True,
                                    adaptive_interval=INTERVAL),
}


def gradients(rank: int, step: int) -> list[np.ndarray]:
    """A rank's gradients: steady for steps 1-6, then 8 times larger (the norm jumps at 7)."""
    rng = np.random.default_rng(1000 * rank + step)
    scale = np.float32(1.0 if step <= 6 else 8.0)
    return [rng.standard_normal(s).astype(np.float32) * scale for s in SHAPES]


def frame(framework: str) -> tuple[Any, Any, Any]:
    """(rank and size, make an exchange, (tensors -> Horovod's dense average as arrays))."""
    if framework == "torch":
        import horovod.torch as hvd
        import torch

        from hvdtrain.torch.compression import make_compressing
        hvd.init()
        params = [torch.zeros(s) for s in SHAPES]
        return ((hvd.rank(), hvd.size()),
                lambda c: make_compressing(c, 7, hvd.rank(), hvd.size(), params),
                lambda gs: [hvd.allreduce(torch.from_numpy(g), op=hvd.Average,
                                          name=f"none.{i}").numpy() for i, g in enumerate(gs)])
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from hvdtrain.tensorflow.compression import make_compressing
    hvd.init()
    return ((hvd.rank(), hvd.size()),
            lambda c: make_compressing(c, 7, hvd.rank(), hvd.size(), SHAPES),
            lambda gs: [hvd.allreduce(tf.constant(g), op=hvd.Average,
                                      name=f"none.{i}").numpy() for i, g in enumerate(gs)])


def main() -> None:
    framework, out = sys.argv[1], Path(sys.argv[2])
    (rank, _), make, dense_mean = frame(framework)
    tensor = (lambda a: __import__("torch").from_numpy(a)) if framework == "torch" else (
        lambda a: __import__("tensorflow").constant(a))
    for name, comm in RUNS.items():
        exchange, steps = make(comm), []
        for step in range(1, STEPS + 1):
            grads = gradients(rank, step)
            low = exchange.rule.accordion.low if exchange.rule.accordion is not None else None
            got = [np.asarray(g) for g in exchange.run([tensor(g) for g in grads])]
            want = dense_mean(grads)
            digest = hashlib.sha256(b"".join(g.tobytes() for g in got)).hexdigest()
            steps.append({"step": step, "low": low, "wire": exchange.stats["wire_bytes"],
                          "dense": exchange.stats["dense_bytes"], "digest": digest,
                          "as_none": all(np.array_equal(g.reshape(w.shape), w)
                                         for g, w in zip(got, want, strict=True))})
        (out / f"{name}.rank{rank}.json").write_text(json.dumps(steps))


if __name__ == "__main__":
    main()
