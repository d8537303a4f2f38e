"""The plan's row for a config prices the run training runs from that config (docs/planner.md, "The
config's own setting"): the same micro-batches, the same global batch, the same accumulated passes,
servers and compression ratio; what it cannot price as training runs it is refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hvdtrain.cli import main
from hvdtrain.config import Config, load_config
from hvdtrain.errors import ConfigError
from hvdtrain.layout import Layout
from hvdtrain.loop import make_sampler
from hvdtrain.pipeline import microbatch_count
from hvdtrain.plan.cluster import Cluster, cluster_from_tree
from hvdtrain.plan.command import configured_setting, knobs_of
from hvdtrain.plan.predict import Prediction, plan
from hvdtrain.plan.profile import MethodProfile, ModelProfile, load_profile, model_key, save_profile
from hvdtrain.world import World

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "digits_torch.yaml"
LINK = {"bandwidth_gbit_s": 1, "latency_us": 50}
CLUSTER = {"nodes": 2, "ranks_per_node": 4, "intra": {"bandwidth_gbit_s": 10, "latency_us": 5},
           "inter": LINK, "servers": {"nodes": 2, **LINK}}
SETTINGS = {"ratio": 0.01, "rank": 2.0, "min_size": 1024.0, "bucket": 512.0}
"""The ``comm`` defaults, as a profile records the settings its ratios were measured at."""


def _profile(cfg: Config) -> ModelProfile:
    """A published profile (it has a layer list) named as ``cfg``'s model, with a top-k ratio
    measured at the default ``comm`` settings."""
    published = load_profile(ROOT / "hvdtrain" / "plan" / "published" / "resnet101.json")
    methods = {**published.compression,
               "topk": MethodProfile(30.0, 0.001, "allgather", dict(SETTINGS))}
    return dataclasses.replace(published, compression=methods, model=model_key(
        cfg.framework, cfg.model.name, cfg.model.options))


def _row(cfg: Config, cluster: Cluster) -> Prediction:
    knobs = knobs_of(cfg)
    name = configured_setting(cfg, cluster, knobs)
    row = next(p for p in plan(_profile(cfg), cluster, knobs).predictions if p.setting == name)
    assert row.reason is None, row.reason
    return row


@pytest.mark.parametrize("overrides", [
    ["pipeline.stages=2", "pipeline.schedule=gpipe"],  # microbatches 0: P
    ["pipeline.stages=2", "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2"],  # P x v
    ["pipeline.stages=2", "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=4",
     "pipeline.microbatches=8"],
    ["pipeline.stages=4", "pipeline.schedule=1f1b", "data.batch_size=64"],
    ["pipeline.stages=8", "data.batch_size=24", "data.eval_batch_size=24"],  # 8 ranks: 2 nodes
    [],
    ["train.backward_passes_per_step=3"],
    ["comm.compression=topk"],
    ["comm.topology=ps", "ps.servers=1"],
    ["shard.stage=3", "shard.prefetch=2"],
    ["pipeline.stages=2", "pipeline.schedule=gpipe", "shard.stage=1"],
])
def test_the_config_row_prices_the_run_training_runs(overrides: list[str]) -> None:
    cfg = load_config(CONFIG, overrides, environ={})
    cluster = cluster_from_tree(CLUSTER)
    row = _row(cfg, cluster)
    pipe = cfg.pipeline
    if pipe.stages > 1:  # the engines' own call (hvdtrain/torch/pipeline.py, tensorflow/pipeline.py)
        assert row.microbatches == microbatch_count(pipe.stages, pipe.microbatches,
                                                    pipe.virtual_stages)
        assert f" m={row.microbatches} " in f"{row.setting} "
        assert f"pipeline.microbatches={row.microbatches}" in row.how
        assert "data.batch_size" not in row.how  # a copy's batch is the config's own
    if cfg.comm.topology == "ps":
        assert row.setting == f"ps dedicated S={cfg.ps.servers}"
    if cfg.shard.stage:
        assert row.setting.endswith(f"shard stage {cfg.shard.stage}")
    runs = [p for p in row.points if p.reason is None]
    assert [p.nodes for p in row.points] == [1, 2] and runs
    for point in runs:
        # Training's global batch: its sampler's samples a step over the data-parallel ranks
        # (every worker, or a pipeline's copies), with World's accumulated passes.
        copies = Layout(point.ranks, pipe.stages).copies
        sampler = make_sampler(cfg, 10**6, World.of(cfg, point.ranks).accumulation)
        assert point.batch == sampler.step_samples(copies)
        assert point.samples_per_s == pytest.approx(point.batch / (point.step_s or 0))


def test_microbatches_zero_is_priced_as_its_resolved_count() -> None:
    cluster = cluster_from_tree(CLUSTER)
    for schedule, virtual in (("1f1b", 1), ("interleaved_1f1b", 2)):
        over = ["pipeline.stages=2", f"pipeline.schedule={schedule}",
                f"pipeline.virtual_stages={virtual}"]
        resolved = _row(load_config(CONFIG, over, environ={}), cluster)
        explicit = _row(load_config(CONFIG, [*over, f"pipeline.microbatches={2 * virtual}"],
                                    environ={}), cluster)
        assert resolved.setting == explicit.setting
        assert [p.step_s for p in resolved.points] == [p.step_s for p in explicit.points]


def test_accumulated_passes_are_priced() -> None:
    cluster = cluster_from_tree(CLUSTER)
    one = _row(load_config(CONFIG, [], environ={}), cluster)
    three = _row(load_config(CONFIG, ["train.backward_passes_per_step=3"], environ={}), cluster)
    profile = _profile(load_config(CONFIG, [], environ={}))
    passes = 2 * (profile.forward_s + profile.backward_s) * 32 / profile.batch_size
    # Two passes more of compute before the same last pass and exchange.
    assert three.points[-1].step_s == pytest.approx((one.points[-1].step_s or 0) + passes)
    assert three.timeline[0].label == "2 accumulated pass(es)"


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.precision=bf16"], "train.precision='bf16': the plan prices float32 compute only"),
    (["comm.topology=ps", "ps.consistency=ssp"], "ps.consistency='ssp': the plan prices bsp"),
    (["comm.topology=ps", "ps.servers=3"], "ps.servers=3: the cluster file has 2 server node"),
])
def test_a_run_the_plan_would_price_otherwise_is_refused(overrides: list[str],
                                                         message: str) -> None:
    cfg = load_config(CONFIG, overrides, environ={})
    with pytest.raises(ConfigError, match=message):
        configured_setting(cfg, cluster_from_tree(CLUSTER), knobs_of(cfg))


def test_a_ratio_measured_at_other_settings_is_not_priced(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = load_config(CONFIG, [], environ={})
    profile, cluster = tmp_path / "p.json", tmp_path / "c.yaml"
    save_profile(_profile(cfg), profile)
    cluster.write_text(json.dumps(CLUSTER))
    common = [str(CONFIG), "--cluster", str(cluster), "--profile", str(profile)]
    assert main(["plan", *common, "comm.compression=topk", "comm.ratio=0.05"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "its ratio was measured at comm.ratio=0.01" in err
    # Not the config's setting: that row alone is not priced, with why.
    knobs = dataclasses.replace(knobs_of(cfg), comm={**SETTINGS, "ratio": 0.05})
    rows = {p.setting: p for p in plan(_profile(cfg), cluster_from_tree(CLUSTER), knobs).predictions}
    assert rows["ring topk"].reason == ("its ratio was measured at comm.ratio=0.01, the config has "
                                        "0.05; profile this config again (hvdtrain plan profile)")
    assert rows["ring"].reason is None and rows["ring"].best is not None
    assert main(["plan", *common, "comm.compression=randomk"]) == 2  # not in the profile
    assert "no figures for the config's setting (ring randomk" in capsys.readouterr().err
