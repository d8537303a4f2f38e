"""``hvdtrain plan``'s shard stages and its memory per rank (docs/planner.md, "Shard stages" and
"Memory per rank"): the steps by hand, the 1.5x of stage 3, ZeRO's formula, the cluster file's
``memory_gib``."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from hvdtrain.cli import main
from hvdtrain.config import load_config
from hvdtrain.errors import ConfigError
from hvdtrain.plan.cluster import Cluster, cluster_from_tree
from hvdtrain.plan.command import configured_setting, knobs_of
from hvdtrain.plan.memory import GIB
from hvdtrain.plan.predict import GROUP_UNPRICED, Knobs, Prediction, plan
from hvdtrain.plan.profile import LayerProfile, ModelProfile, TensorProfile, model_key, save_profile
from hvdtrain.plan.render import table

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "digits_torch.yaml"
LAYER_BYTES = 1e8
"""Each layer's float32 parameters: 2.5e7 parameters."""
ACT = 2**28
"""Each layer's output bytes at the profiled batch (0.25 GiB)."""
TWO = {"nodes": 1, "ranks_per_node": 2, "intra": {"bandwidth_gbit_s": 8, "latency_us": 0},
       "inter": {"bandwidth_gbit_s": 8, "latency_us": 0}}
"""Two ranks, 1e9 bytes/s, no latency: a reduce-scatter or all-gather of a layer takes
``(n-1)/n x 1e8 / 1e9`` = 0.05 s."""


def _profile(layers: int = 2, model: dict | None = None) -> ModelProfile:
    """``layers`` equal layers of 0.1 s forward and 0.2 s backward at batch 8, update 0.04 s."""
    return ModelProfile(
        model=model or {"name": "toy"}, batch_size=8, forward_s=0.1 * layers,
        backward_s=0.2 * layers, update_s=0.04,
        tensors=[TensorProfile("all", int(layers * LAYER_BYTES), 0.2 * layers)],
        layers=[LayerProfile(f"l{i}", int(LAYER_BYTES / 4), 0.1, 0.2, ACT) for i in range(layers)])


def _rows(cluster: Cluster, knobs: Knobs, profile: ModelProfile | None = None
          ) -> dict[str, Prediction]:
    return {p.setting: p for p in plan(profile or _profile(), cluster, knobs).predictions}


def _step(row: Prediction) -> float:
    return row.points[-1].step_s or 0.0


def test_shard_stages_by_hand() -> None:
    rows = _rows(cluster_from_tree(TWO), Knobs(8))
    # Stage 1: passes 0.6, reduce-scatter 0.1, update 0.02 (a half), all-gather 0.1.
    assert _step(rows["shard stage 1"]) == pytest.approx(0.82)
    # Stage 2: forward 0.2; each layer's reduce-scatter (0.05) behind its backward pass (0.2),
    # the last ends at 0.65; update 0.02; two all-gathers after it.
    assert _step(rows["shard stage 2"]) == pytest.approx(0.77)
    assert rows["shard stage 2"].how == "shard.stage=2"
    # Stage 3, prefetch 1: gathers 0-0.05 and 0.05-0.1, forward 0.05-0.25; again before the
    # backward pass 0.25-0.35, backward 0.3-0.7, the reduce-scatters 0.5-0.55 and 0.7-0.75; 0.77.
    three = rows["shard stage 3"]
    assert _step(three) == pytest.approx(0.77)
    comm = [s.label for s in three.timeline if s.lane == "comm"]
    assert comm == ["all-gather l0 (100.00 MB)", "all-gather l1 (100.00 MB)",
                    "all-gather l1 (100.00 MB)", "all-gather l0 (100.00 MB)",
                    "reduce-scatter l1 (100.00 MB)", "reduce-scatter l0 (100.00 MB)"]
    # Prefetch 0: each gather waits for the compute before it: 0.92.
    assert _step(_rows(cluster_from_tree(TWO), Knobs(8, prefetch=0))["shard stage 3"]) == (
        pytest.approx(0.92))
    # Kept from the forward pass to the backward pass: no second gathers; forward ends at 0.25,
    # backward 0.25-0.65, the last reduce-scatter ends at 0.7, update 0.02.
    kept = _rows(cluster_from_tree(TWO), Knobs(8, reshard=False))["shard stage 3"]
    assert _step(kept) == pytest.approx(0.72)
    assert kept.wire_bytes == pytest.approx(4 * LAYER_BYTES)  # two gathers, two scatters


def test_stage_3_moves_one_and_a_half_times_stage_1s_bytes() -> None:
    profile = dataclasses.replace(_profile(8), forward_s=1e-9, backward_s=1e-9, update_s=0.0)
    for tree in (TWO, {**TWO, "nodes": 2, "ranks_per_node": 4}):
        rows = _rows(cluster_from_tree(tree), Knobs(8), profile)
        one, two, three = (rows[f"shard stage {s}"] for s in (1, 2, 3))
        assert one.wire_bytes == two.wire_bytes == pytest.approx(2 * profile.gradient_bytes)
        assert three.wire_bytes == pytest.approx(1.5 * (one.wire_bytes or 0))
        # With no compute and no latency the link's time shows the same ratios.
        assert _step(three) == pytest.approx(1.5 * _step(one), rel=1e-6)
        assert _step(two) == pytest.approx(_step(one), rel=1e-6)
    # fp16 halves the reduce-scatters only.
    half = _rows(cluster_from_tree(TWO), Knobs(8, compression="fp16"), profile)
    assert half["shard stage 3"].wire_bytes == pytest.approx(2.5 * profile.gradient_bytes)
    assert half["shard stage 1"].wire_bytes == pytest.approx(1.5 * profile.gradient_bytes)


def test_memory_follows_zeros_formula() -> None:
    """Adam in float32 over N ranks, P parameters: 16, 8 + 12/N, 4 + 16/N and 16/N bytes a
    parameter (stages 1-2 with hvdtrain's float32 shard, 4/N), plus the activations, plus stage
    3's ``prefetch`` + 1 gathered units."""
    p, acts = 4 * LAYER_BYTES / 4, 4 * ACT * 2  # four layers; batch 16 is twice the profile's
    for tree, n in ((TWO, 2), ({**TWO, "nodes": 2, "ranks_per_node": 2}, 4)):
        rows = _rows(cluster_from_tree(tree), Knobs(16, prefetch=2), _profile(4))
        got = {s: rows[s].points[-1].memory_gib for s in rows if rows[s].points}
        for setting, per in (("ring", 16), ("shard stage 1", 8 + 12 / n),
                             ("shard stage 2", 4 + 16 / n), ("shard stage 3", 16 / n)):
            gathered = 3 * LAYER_BYTES if setting == "shard stage 3" else 0
            assert got[setting] == pytest.approx((per * p + acts + gathered) / GIB), setting
    # SGD with momentum (4 bytes a parameter of state) as the config's optimizer sets it.
    cfg = load_config(CONFIG, ["optim.name=sgd", "optim.momentum=0.9"], environ={})
    assert knobs_of(cfg).state_bytes == 4
    sgd = _rows(cluster_from_tree(TWO), dataclasses.replace(knobs_of(cfg), batch_size=8))
    assert sgd["ring"].points[0].memory_gib == pytest.approx((12 * 5e7 + 2 * ACT) / GIB)
    # A pipeline's busiest rank: 1F1B's first stage holds P = 2 micro-batches of its layer.
    pipe = sgd["pipeline P=2 m=2 1f1b"].points[0].memory_gib
    assert pipe == pytest.approx((12 * 2.5e7 + 2 * ACT / 2) / GIB)


def test_a_rank_too_small_for_the_ring_runs_stage_3() -> None:
    # Four layers, Adam, batch 8: the ring needs 16 x 1e8 + 1 GiB, stage 3 at 4 ranks 4e8 +
    # 1 GiB + 2e8 of gathered units.
    tree = {**TWO, "nodes": 2, "ranks_per_node": 2, "memory_gib": 1.8}
    rows = _rows(cluster_from_tree(tree), Knobs(8), _profile(4))
    ring, three = rows["ring"], rows["shard stage 3"]
    assert ring.best is None and all("more than the cluster's memory_gib=1.8" in (p.reason or "")
                                     for p in ring.points)
    assert (ring.points[0].reason or "").startswith("needs 2.49 GiB a rank (model state 1.49, ")
    assert three.best is not None and three.best.nodes == 2
    assert three.best.memory_gib == pytest.approx((4e8 + GIB + 2e8) / GIB)
    lines = table(plan(_profile(4), cluster_from_tree(tree), Knobs(8))).splitlines()
    skipped = lines[lines.index("not applicable:") + 1:]
    assert any(line.split()[0] == "ring" and "needs 2.49 GiB" in line for line in skipped)
    # Without memory_gib nothing is checked.
    assert _rows(cluster_from_tree({**tree, "memory_gib": 0}), Knobs(8), _profile(4))[
        "ring"].best is not None


@pytest.mark.parametrize(("line", "message"), [
    ("memory_gib: -1", "memory_gib=-1"),
    ("memory_gb: 4", "unknown key 'memory_gb'"),
    ("memory_gib: lots", "memory_gib='lots'"),
])
def test_a_bad_memory_key_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                      line: str, message: str) -> None:
    bad, profile = tmp_path / "c.yaml", tmp_path / "p.json"
    bad.write_text(yaml.safe_dump(TWO) + line + "\n")
    save_profile(_profile(), profile)
    assert main(["plan", "--profile", str(profile), "--cluster", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err
    with pytest.raises(ConfigError, match="memory_gib"):
        cluster_from_tree({**TWO, "memory_gib": -1})


@pytest.mark.parametrize(("overrides", "expect"), [
    (["shard.stage=2"], {}),
    (["shard.stage=3", "shard.prefetch=0"], {"prefetch": 0}),
    (["shard.stage=3", "shard.reshard_after_forward=false"], {"reshard": False}),
    (["shard.stage=2", "comm.compression=fp16"], {"compression": "fp16"}),
])
def test_the_config_row_is_its_shard_stage(overrides: list[str], expect: dict) -> None:
    cfg = load_config(CONFIG, ["optim.name=sgd", "optim.momentum=0.9", *overrides], environ={})
    cluster = cluster_from_tree(TWO)
    name = configured_setting(cfg, cluster, knobs_of(cfg))
    assert name == f"shard stage {cfg.shard.stage}"
    profile = dataclasses.replace(_profile(), batch_size=cfg.data.batch_size, model=model_key(
        cfg.framework, cfg.model.name, cfg.model.options))

    def row(knobs: Knobs) -> tuple[float, float | None, float | None]:
        got = next(p for p in plan(profile, cluster, knobs).predictions if p.setting == name)
        return _step(got), got.wire_bytes, got.points[-1].memory_gib
    by_hand = Knobs(cfg.data.batch_size, state_bytes=4.0, **expect)
    assert row(knobs_of(cfg)) == row(by_hand)
    if expect:  # and the setting moves the row: the plan reads it
        assert row(by_hand) != row(Knobs(cfg.data.batch_size, state_bytes=4.0))


def test_pipeline_copies_sharded_at_stage_1() -> None:
    """A config with shard.stage=1 runs its pipeline settings with each stage's copies sharded:
    their rows say so, price a reduce-scatter and an all-gather, and hold 1/N of the state."""
    tree = {**TWO, "nodes": 2, "ranks_per_node": 2}
    plain = _rows(cluster_from_tree(tree), Knobs(8))["pipeline P=2 m=2 1f1b"]
    sharded = _rows(cluster_from_tree(tree), Knobs(8, shard_stage=1))[
        "pipeline P=2 m=2 1f1b shard stage 1"]
    assert [s.label for s in sharded.timeline if s.lane == "comm"] == [
        "stage reduce-scatter 100.00 MB over 2 copies", "stage all-gather"]
    # Stage 0 of 2 holds one layer (2.5e7 parameters) and 2 micro-batches of half a batch; Adam
    # over its 2 copies: 8 + (8 + 4)/2 = 14 bytes a parameter, against 16.
    assert sharded.points[-1].memory_gib == pytest.approx((14 * 2.5e7 + ACT) / GIB)
    assert plain.points[-1].memory_gib == pytest.approx((16 * 2.5e7 + ACT) / GIB)
    # The same bytes as the stage allreduce, in two halves around the update of a half.
    assert [s.label for s in plain.timeline if s.lane == "comm"] == [
        "stage allreduce 100.00 MB over 2 copies"]


def test_a_shard_group_within_nodes_is_not_priced() -> None:
    rows = _rows(cluster_from_tree(TWO), Knobs(8, shard_group="node"))
    for stage in (1, 2, 3):
        assert rows[f"shard stage {stage}"].reason == GROUP_UNPRICED
    assert rows["ring"].best is not None


def test_a_config_sharded_within_nodes_is_refused() -> None:
    from hvdtrain.config import ShardConfig

    if "group" not in {f.name for f in dataclasses.fields(ShardConfig)}:
        pytest.skip("shard.group is not in this checkout's config")
    cfg = load_config(CONFIG, ["shard.stage=2", "shard.group=node"], environ={})
    with pytest.raises(ConfigError, match=re.escape(GROUP_UNPRICED)):
        configured_setting(cfg, cluster_from_tree(TWO), knobs_of(cfg))


def test_accumulated_passes_carry_their_collectives() -> None:
    """train.backward_passes_per_step=3: stages 2-3 reduce-scatter (and stage 3 gathers) in
    every pass, stage 1 once a step (docs/sharding.md's wire_bytes)."""
    cluster = cluster_from_tree(TWO)
    one, three = _rows(cluster, Knobs(8)), _rows(cluster, Knobs(8, accumulation=3))
    m = 2 * LAYER_BYTES
    assert [three[f"shard stage {s}"].wire_bytes for s in (1, 2, 3)] == pytest.approx(
        [2 * m, 3 * m + m, 3 * 3 * m])
    # Each earlier pass: its compute (0.6) and, at stage 3, what its gathers and last
    # reduce-scatter add beyond it (0.75 - 0.6; stage 2's last reduce-scatter: 0.05).
    for stage, beyond in ((1, 0.0), (2, 0.05), (3, 0.15)):
        want = _step(one[f"shard stage {stage}"]) + 2 * (0.6 + beyond)
        assert _step(three[f"shard stage {stage}"]) == pytest.approx(want), stage
