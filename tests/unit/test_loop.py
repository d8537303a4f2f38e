"""The loop and the elastic policy at several ranks: simulated ranks in threads, each with the NumPy
engine (:mod:`tests.unit.numpy_world`), no framework and no Horovod."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.checkpoint import CheckpointManager
from hvdtrain.config import Config
from hvdtrain.data.digits import DigitsDataset
from hvdtrain.data.sampler import StepIndices
from hvdtrain.elastic import IndexRecord, world_at
from hvdtrain.loop import Callback, Loop, Position, make_sampler, total_steps
from hvdtrain.observe.records import MetricsLogger
from hvdtrain.world import World
from tests.conftest import CONFIG, quiet_config
from tests.unit.numpy_world import Hub, NumpyEngine

DATA = DigitsDataset()


class Record(Callback):
    """Keeps this rank's sample indices of every step, as elastic mode's commits do."""

    def __init__(self) -> None:
        self.record = IndexRecord(enabled=True)

    def on_step_end(self, epoch: int, indices: StepIndices) -> None:
        self.record.add(epoch, indices)


def run_world(cfg: Config, world: World, start: Position, directory: Path,
              state: bytes | None) -> list[tuple[Position, bytes, Record]]:
    """Every rank of ``world`` in a thread: the engines take rank 0's ``state`` (or rank 0's fresh
    one) by broadcast, as a reset does, then each runs the loop from ``start``."""
    hub = Hub(world.size)

    def rank(r: int) -> tuple[Position, bytes, Record]:
        engine = NumpyEngine(cfg, DATA, r, hub)
        if state is not None and r == 0:
            engine.load_state(state, "the committed state")
        engine.resize(r, world.size, world.accumulation)
        engine.broadcast_state()
        sampler = make_sampler(cfg, len(DATA.train()), world.accumulation)
        record = Record()
        loop = Loop(cfg, world, engine, DATA, CheckpointManager(cfg.checkpoint, directory),
                    MetricsLogger([]), start=Position(**vars(start)),
                    total=total_steps(cfg.train, sampler, world.size, start), callbacks=[record])
        loop.run()
        engine.gather_state()
        return loop.pos, engine.state_bytes({}), record

    with ThreadPoolExecutor(world.size) as pool:
        return list(pool.map(rank, range(world.size)))


def indices(results: list[tuple[Position, bytes, Record]]) -> np.ndarray:
    """Every rank's indices of epoch 0, in one array."""
    for _, _, rec in results:
        rec.record.gather(lambda pending: [pending])
    return np.concatenate([a for _, _, rec in results for a in rec.record.committed.get(0, [])])


@pytest.mark.parametrize("on_resize", ["scale_lr", "keep_global_batch"])
def test_a_reset_to_another_world_size_reshards_the_epochs_remaining_samples(tmp_path, on_resize):
    cfg = quiet_config(CONFIG, tmp_path, "data.batch_size=32", "train.backward_passes_per_step=3",
                       "train.epochs=1", "train.max_steps=4", "elastic.enabled=true",
                       f"elastic.on_resize={on_resize}", "comm.compression=topk", "comm.min_size=0",
                       "comm.dense_steps=1")  # compressed from step 2, residuals to reshard
    before = run_world(cfg, world_at(cfg, 2, 2), Position(), tmp_path / "a", None)
    position, state = before[0][0], before[0][1]
    assert position.step == 4 and position.in_epoch == 4 * 2 * 3 * 32
    assert all(p == position for p, _, _ in before)  # every rank stands at the same place
    # Three ranks now: the rest of the epoch, re-sharded over them.
    cfg3 = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=0))
    world = world_at(cfg3, 2, 3)
    after = run_world(cfg3, world, position, tmp_path / "b", state)
    assert after[0][0].epoch == 1 and after[0][0].samples == len(DATA.train())
    seen = np.concatenate([indices(before), indices(after)])
    assert len(seen) == len(DATA.train())
    assert np.array_equal(np.sort(seen), np.arange(len(DATA.train())))  # each sample once
    if on_resize == "keep_global_batch":  # 3 ranks x 2 micro-batches: the global batch of 2 x 3
        assert world == World(3, 2, pytest.approx(cfg.optim.lr * 2 / 3))
    else:  # the per-rank batch stays; the schedule scales the rate with the size
        assert world == World(3, 3, cfg.optim.lr)
