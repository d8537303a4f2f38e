"""TensorFlow pipeline stages: the measured bubble against (P-1)/(m+P-1), and what one
stage-to-stage message costs by Horovod's ``alltoall`` and by its ``broadcast``.

Bubble: ``horovodrun -np P`` trains a stack of ``2P`` equal dense layers (``Balanced``: every stage
the same compute) on synthetic rows with ``pipeline.stages=P`` and ``m`` micro-batches, under
``gpipe`` and ``1f1b`` in one job. Each stage's steps are timed by the engine's own stats: its
forward and backward passes (``compute_s``) and the seconds it spent in messages (``pipe_wait_s``:
waiting for its neighbour plus the transfer). The measured bubble of a step is ``pipe_wait_s /
(compute_s + pipe_wait_s)`` on the stage, the median over the steady steps and the stages. Theory
counts the passes alone; every message also costs at least one Horovod cycle, which the table
shows beside it (``comm.cycle_time_ms``).

Messages: two ranks, a 2-rank process set, ``--rounds`` messages of each size each way, by
``alltoall`` (splits ``[0, n]`` / ``[0, 0]``) and by ``broadcast`` (root: the sender), interleaved.

Usage (from the repository root; prints a Markdown table)::

    .venv/bin/python benchmarks/pipeline_tf.py bubble --stages 2 --micro 2 4 8
    .venv/bin/python benchmarks/pipeline_tf.py messages --sizes 4096 1048576
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def balanced_layers(width: int, count: int) -> list[Any]:
    """``count`` dense layers of ``width`` units (ReLU) on the inputs' last axis: equal stages."""
    import functools

    import keras

    from hvdtrain.adapters import Layer
    return [Layer(f"dense{i}", functools.partial(keras.layers.Dense, width, activation="relu"))
            for i in range(count)]


def _adapter() -> type:
    from hvdtrain.adapters import ModelAdapter

    class Balanced(ModelAdapter):
        """Equal dense layers on rows of ``width`` (synthetic images of 1 x 1 x width); loss: the
        summed squares of the output, scaled down."""

        def __init__(self, width: int = 256, layers: int = 4) -> None:
            super().__init__(width=width, layers=layers)
            self.width, self.count = width, layers

        def layers(self, spec: Any) -> list[Any]:
            return balanced_layers(self.width, self.count)

        def build(self, spec: Any) -> Any:
            import keras
            return keras.Sequential([keras.Input(spec.input_shape),
                                     *(f() for f in self.layers(spec))])

        def output_loss(self, output: Any, y: Any, training: bool = True) -> tuple[Any, dict]:
            import tensorflow as tf
            return tf.reduce_sum(tf.square(output)) * 1e-6, {}

        def loss_and_metrics(self, model: Any, x: Any, y: Any, training: bool = True) -> Any:
            return self.output_loss(model(x, training=training), y, training)

    return Balanced


def bubble_worker(args: argparse.Namespace) -> None:
    """One rank of the bubble job: trains each schedule and micro-batch count, prints one JSON
    line a configuration on rank 0."""
    from hvdtrain.config import load_config
    from hvdtrain.driver import make_dataset
    from hvdtrain.engine import make_engine
    from hvdtrain.loop import make_sampler
    from hvdtrain.registry import MODELS

    MODELS["tensorflow"].register("bench_balanced", _adapter())
    for schedule in args.schedules:
        for m in args.micro:
            cfg = load_config(ROOT / "configs" / "digits_tf.yaml", [
                "model.name=bench_balanced", "model.options={}", f"model.options.width={args.width}",
                f"model.options.layers={2 * args.stages}", "data.name=synthetic_images",
                "data.options.channels=1", "data.options.height=1",
                f"data.options.width={args.width}", "data.options.train_samples=8192",
                f"data.batch_size={args.rows * m}", f"data.eval_batch_size={args.rows * m}",
                f"pipeline.stages={args.stages}", f"pipeline.microbatches={m}",
                f"pipeline.schedule={schedule}", "checkpoint.enabled=false",
                "checkpoint.every_steps=0",
                f"comm.cycle_time_ms={args.cycle_ms}", "log.console=false", "log.wandb=disabled",
            ], environ={})
            dataset = make_dataset(cfg)
            engine = make_engine(cfg, dataset)
            engine.broadcast_state()
            sampler = make_sampler(cfg, len(dataset.train()), 1)
            shares, waits, walls = [], [], []
            for n, step in enumerate(sampler.steps(0, engine.data_rank, engine.data_size)):
                if n >= args.steps + args.warmup:
                    break
                started = time.perf_counter()
                engine.train_step(step, 0.001)
                wall = time.perf_counter() - started
                stats = engine.step_stats()
                if n >= args.warmup:
                    busy = stats["compute_s"] + stats["pipe_wait_s"]
                    shares.append(stats["pipe_wait_s"] / busy)
                    waits.append(stats["pipe_wait_s"])
                    walls.append(wall)
            mine = {"bubble": statistics.median(shares), "wait_s": statistics.median(waits),
                    "step_s": statistics.median(walls)}
            every = engine.collectives.allgather_object(mine)
            if engine.rank == 0:
                print("RESULT " + json.dumps({"schedule": schedule, "stages": args.stages, "m": m,
                                              "ranks": every}), flush=True)


def messages_worker(args: argparse.Namespace) -> None:
    """Two ranks: time each message size by alltoall and by broadcast, interleaved."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init(process_sets="dynamic")
    pair = hvd.add_process_set([0, 1]) if hvd.size() > 2 else hvd.global_process_set
    rank = hvd.rank()
    out = []
    for size in args.sizes:
        rows = size // 4 // 256
        data = tf.ones([rows, 256], tf.float32)
        empty = tf.zeros([0, 256], tf.float32)
        times: dict[str, list[float]] = {"alltoall": [], "broadcast": []}
        for r in range(args.rounds):
            sender = r % 2
            for how in ("alltoall", "broadcast") if r % 4 < 2 else ("broadcast", "alltoall"):
                started = time.perf_counter()
                if how == "alltoall":
                    splits = [0, rows] if sender == 0 else [rows, 0]
                    mine = (data, splits) if rank == sender else (empty, [0, 0])
                    hvd.alltoall(mine[0], splits=tf.constant(mine[1], tf.int32),
                                 name=f"bench.a.{size}", process_set=pair)
                else:
                    hvd.broadcast(data, sender, name=f"bench.b.{size}", process_set=pair)
                times[how].append(time.perf_counter() - started)
        out.append({"bytes": size, **{k: statistics.median(v[2:]) for k, v in times.items()}})
    if rank == 0:
        print("RESULT " + json.dumps({"messages": out}), flush=True)


def launch(np_: int, argv: list[str], timeout: float) -> list[dict]:
    """Runs this file's worker under ``horovodrun -np np_ --gloo``; returns rank 0's results."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([str(BIN / "horovodrun"), "-np", str(np_), "--gloo", sys.executable,
                           __file__, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines()
            if "RESULT " in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["bubble", "messages"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=64, help="samples per micro-batch")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cycle-ms", type=float, default=1.0)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536, 1048576])
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    if args.worker:
        (bubble_worker if args.what == "bubble" else messages_worker)(args)
        return
    argv = [*sys.argv[1:], "--worker"]
    if args.what == "bubble":
        print("| schedule | P | m | theory (P-1)/(m+P-1) | measured, per stage | step s |")
        print("|---|---|---|---|---|---|")
        for r in launch(args.stages, argv, timeout=1800):
            theory = (r["stages"] - 1) / (r["m"] + r["stages"] - 1)
            per = ", ".join(f"{x['bubble']:.3f}" for x in r["ranks"])
            step = statistics.median(x["step_s"] for x in r["ranks"])
            print(f"| {r['schedule']} | {r['stages']} | {r['m']} | {theory:.3f} | {per} | "
                  f"{step:.4f} |")
    else:
        print("| bytes | alltoall ms | broadcast ms |")
        print("|---|---|---|")
        for r in launch(2, argv, timeout=900):
            for row in r["messages"]:
                print(f"| {row['bytes']} | {row['alltoall'] * 1e3:.3f} | "
                      f"{row['broadcast'] * 1e3:.3f} |")


if __name__ == "__main__":
    main()
