"""PyTorch pipeline stages with every optimizer setting the docs list train as one process does.

2 stages at ``horovodrun -np 2`` against one process (the ring at one rank) on the same global
batch of 64 (4 micro-batches of 16), for 6 steps of the digits MLP: every step's loss within
1e-5 relative and the final parameters within 1e-5, for Adam; AdamW with decoupled weight decay,
a warm-up and a cosine schedule; Adam with L2 weight decay; SGD with momentum and weight decay.
(With one copy the warm-up rises from ``optim.lr`` to ``optim.lr`` times one copy: its rate is
the ring's at one rank, which is the point.) ``train.precision`` other than fp32 is refused with
stages, so it has no row.

What this catches: the ring makes a fresh optimizer's state with Horovod's
``broadcast_optimizer_state``, a step with zero gradients, so Adam's first real update is its
second (bias correction 0.74 of the first's) and weight decay acts once before step 1. Stages
that skip that step move every weight by about a quarter of Adam's learning rate more at step 1
(loss 2nd decimal apart by step 2); SGD with momentum but no decay cannot tell.

`make test` runs the one-process launch and Gloo's -np 2 launch (every optimizer, back to back in
each). `long` (`make test-long`): MPI's -np 2 launch (Adam; `tests/multirank/test_pipeline.py`
gives torch's stages an MPI row in `make test`), and Adam at -np 4, 2 stages x 2 copies of 32
samples, where each stage's copies take copy 0's state in their process set.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import read_jsonl
from tests.multirank.conftest import Launch
from tests.multirank.test_pipeline import assert_same_model, launch, whole_model

COMMON = ("data.batch_size=64,train.max_steps=6,log.every_steps=1,"
          "checkpoint.enabled=false,checkpoint.every_steps=0,train.stall_timeout_s=120")
OPTIMIZERS = {
    "adam": "optim.name=adam,optim.lr=0.01,optim.warmup_steps=0,optim.schedule=constant",
    "adamw": "optim.name=adamw,optim.lr=0.01,optim.weight_decay=0.05,optim.warmup_steps=2,"
             "optim.schedule=cosine",
    "adam_l2": "optim.name=adam,optim.lr=0.01,optim.weight_decay=0.01,optim.warmup_steps=0,"
               "optim.scale_lr=false,optim.schedule=constant",
    "sgd_decay": "optim.name=sgd,optim.lr=0.1,optim.weight_decay=0.05,optim.warmup_steps=0",
}
STAGES = "pipeline.stages=2,pipeline.microbatches=4"  # one process has no micro-batches
# Rounding in another order (4 micro-batches summed against one batch of 64) over 6 steps moves
# losses by about 1e-7 relative and weights by about 1e-7; without the zero-gradient step Adam's
# first update differs by about 2.6e-3 a weight (a quarter of lr) and the losses in the 3rd digit.
RTOL, ATOL = 1e-5, 1e-5
LAUNCHES = {(2, "gloo"): list(OPTIMIZERS), (2, "mpi"): ["adam"], (4, "gloo"): ["adam"]}
"""The staged launches' runs, by (ranks, controller)."""
ROWS = [(2, "gloo", name) for name in OPTIMIZERS] + [
    pytest.param(np_, controller, "adam", marks=pytest.mark.long)
    for np_, controller in ((2, "mpi"), (4, "gloo"))]
TWO_COPIES = "data.batch_size=32,optim.lr=0.005"
"""At -np 4 (2 stages x 2 copies): the same global batch of 64 and, scaled by the 2 copies, the
same rate. Only for runs without warm-up (it starts from the one-copy rate) or decay (Horovod's
zero-gradient step decays at the unscaled rate, on the ring as well)."""
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Launch:
    """Every optimizer's run at one process without stages, back to back in one launch."""
    runs = [f"{name}:{COMMON},{extra}" for name, extra in OPTIMIZERS.items()]
    return launch(1, "gloo", tmp_path_factory.mktemp("optim-np1"), runs)


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """``staged(np, controller)``: the launch of 2 stages at ``np`` ranks for its runs
    (:data:`LAUNCHES`), on first use."""
    cache: dict[tuple[int, str], Launch] = {}

    def get(np_: int, controller: str) -> Launch:
        if (np_, controller) not in cache:
            copies = f",{TWO_COPIES}" if np_ == 4 else ""
            runs = [f"{name}:{COMMON},{OPTIMIZERS[name]},{STAGES}{copies}"
                    for name in LAUNCHES[np_, controller]]
            cache[np_, controller] = launch(
                np_, controller, tmp_path_factory.mktemp(f"optim-np{np_}-{controller}"), runs)
        return cache[np_, controller]

    return get


def step_losses(out: Path, run: str) -> list[float]:
    """Each step's train loss, in step order (``log.every_steps=1``)."""
    records = [r for r in read_jsonl(out / run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)), run
    return [r["loss"] for r in records]


@pytest.mark.parametrize(("np_", "controller", "name"), ROWS)
def test_two_stages_equal_one_process_with_this_optimizer(one_process, staged, np_, controller,
                                                          name):
    launched = staged(np_, controller)
    want, got = step_losses(one_process.out, name), step_losses(launched.out, name)
    assert len(want) == 6
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=0, err_msg=f"{name}: step losses")
    assert want[-1] < want[0]  # it trains: the comparison is not of two idle runs
    ref, _ = one_process.rank(name, 0)
    copies = [[0, 1], [2, 3]][:np_ // 2]
    for ranks in copies:
        assert_same_model(whole_model(launched, name, ranks), ref, ATOL)
    assert launched.summary(name)["pipeline"] == f"2 stages x {len(copies)} copies"
