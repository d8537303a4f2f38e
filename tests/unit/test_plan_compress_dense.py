"""The plan prices a compressing method's run with its dense start (docs/planner.md, "The formulas"):
``comm.dense_steps`` as training resolves it, the dense steps' bytes and allreduce in the run's
mean step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hvdtrain.config import load_config
from hvdtrain.errors import ConfigError
from hvdtrain.plan import costs
from hvdtrain.plan.cluster import cluster_from_tree
from hvdtrain.plan.command import dense_share, knobs_of
from hvdtrain.plan.predict import Prediction, plan, run_wire_bytes
from hvdtrain.plan.profile import MethodProfile, load_profile

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "digits_torch.yaml"
LINK = {"bandwidth_gbit_s": 0.1, "latency_us": 50}
CLUSTER = {"nodes": 2, "ranks_per_node": 1, "intra": {"bandwidth_gbit_s": 10, "latency_us": 5},
           "inter": LINK}
SETTINGS = {"ratio": 0.01, "rank": 2.0, "min_size": 1024.0, "bucket": 512.0}


def _rows(overrides: list[str]) -> dict[str, Prediction]:
    """The plan's rows of a published profile with a top-k ratio of 50 (kernels free), for the
    digits config with ``overrides``."""
    profile = load_profile(ROOT / "hvdtrain" / "plan" / "published" / "resnet101.json")
    profile = dataclasses.replace(profile, compression={
        "topk": MethodProfile(50.0, 0.0, "allgather", dict(SETTINGS))})
    knobs = knobs_of(load_config(CONFIG, overrides, environ={}))
    return {p.setting: p for p in plan(profile, cluster_from_tree(CLUSTER), knobs).predictions}


@pytest.mark.parametrize(("overrides", "share"), [
    ([], 0.03),  # the default: comm.dense_fraction of the run
    (["comm.compression=topk", "comm.dense_fraction=0.1"], 0.1),
    (["comm.compression=topk", "comm.dense_steps=0"], 0.0),
    (["comm.compression=topk", "comm.dense_steps=50", "train.max_steps=1000"], 0.05),
    # the default's floor, comm.dense_min_steps=30, where the run's length is known: 30 of 200
    (["comm.compression=topk", "train.max_steps=200"], 0.15),
    (["comm.compression=topk", "train.max_steps=1000"], 0.03),  # the floor no longer binds
    (["comm.compression=topk", "train.max_steps=20"], 1.0),  # all dense
])
def test_the_dense_share_is_training_s(overrides: list[str], share: float) -> None:
    assert dense_share(load_config(CONFIG, overrides, environ={})) == pytest.approx(share)


def test_a_dense_count_without_the_run_s_length_is_refused() -> None:
    cfg = load_config(CONFIG, ["comm.compression=topk", "comm.dense_steps=50"], environ={})
    with pytest.raises(ConfigError, match=r"comm.dense_steps=50: .*train.max_steps"):
        knobs_of(cfg)


def test_the_run_s_bytes_include_its_dense_steps() -> None:
    # 10% dense at 50x: a step's mean is 0.1 + 0.9 / 50 = 0.118 of the float32 gradient (8.5x).
    assert run_wire_bytes(1000.0, 50.0, 0.1) == pytest.approx(118.0)
    none = _rows(["comm.compression=topk", "comm.dense_steps=0"])["ring topk"]
    some = _rows(["comm.compression=topk", "comm.dense_fraction=0.1"])["ring topk"]
    m = load_profile(ROOT / "hvdtrain" / "plan" / "published" / "resnet101.json").gradient_bytes
    assert none.wire_bytes == pytest.approx(m / 50)
    assert some.wire_bytes == pytest.approx(m * 0.118)
    # Two nodes over 100 Mbit/s: the run's mean step adds a tenth of the dense allreduce's
    # time over the compressed step's, less a tenth of the compressed collective.
    c = cluster_from_tree(CLUSTER)
    dense = costs.flat_allreduce(m, 2, 1, c.intra, c.inter, c.overhead_s)
    sparse = costs.ring_allgather(m / 50, 2, c.inter, c.overhead_s)
    assert some.best is not None and none.best is not None
    assert some.best.step_s - none.best.step_s == pytest.approx(0.1 * (dense - sparse), rel=1e-6)
    assert "dense start, 10% of the steps" in some.timeline[-2].label
