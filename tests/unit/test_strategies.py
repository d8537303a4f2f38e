"""The strategies' registry and the one compatibility table (hvdtrain/strategies/): the config
refuses with it, ``hvdtrain plan`` gives the same reason, docs/compatibility.md prints it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from hvdtrain.config import load_config
from hvdtrain.errors import ConfigError, HvdtrainError
from hvdtrain.exchange import exchange_kind
from hvdtrain.pipeline.schedules import SCHEDULES
from hvdtrain.plan.cluster import cluster_from_tree
from hvdtrain.plan.command import knobs_of, refuser
from hvdtrain.plan.predict import plan
from hvdtrain.plan.profile import load_profile, model_key
from hvdtrain.strategies.base import STAGE_PARTS, WHOLE, Strategy
from hvdtrain.strategies.page import markdown
from hvdtrain.strategies.pipeline import TENSORFLOW_SCHEDULES
from hvdtrain.strategies.table import (
    RULES,
    STRATEGIES,
    active,
    engine_path,
    exchange_of,
    exchange_path,
    refusal,
    strategy,
    with_settings,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "digits_torch.yaml"
LINK = {"bandwidth_gbit_s": 1, "latency_us": 50}
CLUSTER = {"nodes": 2, "ranks_per_node": 4, "intra": {"bandwidth_gbit_s": 10, "latency_us": 5},
           "inter": LINK, "servers": {"nodes": 2, **LINK}}
IDS = [f"{r.row}-{r.column}" for r in RULES]


def _error(overrides: dict[str, Any]) -> str | None:
    """The run's one-line error for the digits config with ``overrides``, or None."""
    try:
        load_config(CONFIG, [f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                             for k, v in overrides.items()], environ={})
    except ConfigError as err:
        return str(err)
    return None


def test_the_registry_holds_the_four_strategies_and_refuses_a_duplicate():
    assert sorted(STRATEGIES) == ["pipeline", "ps", "ring", "shard"]
    with pytest.raises(HvdtrainError, match="strategy 'ring' is already registered"):
        STRATEGIES.register("ring", Strategy("ring", "again", lambda cfg: True))
    with pytest.raises(HvdtrainError, match="unknown strategy 'tensor'; known: pipeline, ps, "
                                            "ring, shard"):
        strategy("tensor")


def test_each_strategy_says_when_a_config_runs_it():
    def names(*overrides: str) -> list[str]:
        return active(load_config(CONFIG, list(overrides), environ={}))
    assert names() == ["ring"]
    assert names("comm.topology=ps") == ["ps"]
    assert names("shard.stage=1") == ["shard"]
    assert names("pipeline.stages=2") == ["pipeline", "ring"]


@pytest.mark.parametrize("rule", RULES, ids=IDS)
def test_each_rule_is_the_error_its_example_config_gets(rule):
    cfg = with_settings(load_config(CONFIG, environ={}), rule.example)
    assert rule.applies(cfg) and strategy(rule.row).active(cfg)
    assert refusal(cfg) == rule.message(cfg)
    assert _error(dict(rule.example)) == rule.message(cfg)


@pytest.mark.parametrize(("overrides", "path"), [
    ([], "hvdtrain.torch.engine:TorchEngine"),
    (["framework=tensorflow"], "hvdtrain.tensorflow.engine:TensorFlowEngine"),
    (["comm.topology=ps"], "hvdtrain.torch.engine:TorchEngine"),
    (["shard.stage=1"], "hvdtrain.torch.engine:TorchEngine"),  # its exchange shards
    (["shard.stage=1", "framework=tensorflow"], "hvdtrain.tensorflow.shard:ShardedEngine"),
    (["pipeline.stages=2"], "hvdtrain.torch.pipeline:PipelineEngine"),
    (["pipeline.stages=2", "framework=tensorflow"], "hvdtrain.tensorflow.pipeline:PipelineEngine"),
])
def test_the_engine_is_a_look_up_in_the_registry(overrides, path):
    assert engine_path(load_config(CONFIG, overrides, environ={})) == path
    module, _, name = path.partition(":")
    source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
    assert f"class {name}(" in source  # the path names a real class, without importing it


def test_with_settings_leaves_the_config_as_it_was():
    cfg = load_config(CONFIG, environ={})
    changed = with_settings(cfg, {"pipeline.stages": 2, "elastic.enabled": True, "seed": 3})
    assert (changed.pipeline.stages, changed.elastic.enabled, changed.seed) == (2, True, 3)
    assert (cfg.pipeline.stages, cfg.elastic.enabled, cfg.seed) == (1, False, 0)
    assert changed.data is cfg.data  # sections not named are shared, not copied


@pytest.mark.parametrize("rule", RULES, ids=IDS)
def test_the_plan_refuses_each_pair_with_the_runs_message(rule):
    """For every refused pair: a config with the column's setting, planned; each setting the plan
    prices that the run would refuse by the table carries the run's ConfigError as its reason."""
    cfg = load_config(CONFIG, environ={})
    published = load_profile(ROOT / "hvdtrain" / "plan" / "published" / "resnet101.json")
    profile = dataclasses.replace(published, model=model_key(cfg.framework, cfg.model.name,
                                                             cfg.model.options))
    base = with_settings(cfg, rule.example)
    result = plan(profile, cluster_from_tree(CLUSTER), knobs_of(cfg), refuser(base))
    compared = 0
    for pred in result.predictions:
        if not pred.settings:
            continue
        overrides = {**rule.example, **pred.settings}
        error = _error(overrides)
        if error is not None and error == refusal(with_settings(cfg, overrides)):
            assert pred.reason == error, pred.setting
            compared += 1
        elif error is None:
            assert pred.reason is None or pred.reason != refusal(base), pred.setting
    assert compared, f"no planned setting exercises {rule.row} x {rule.column}"


def test_the_tensorflow_schedules_are_those_the_schedules_say():
    runs = tuple(n for n, s in SCHEDULES.items() if "tensorflow" in s.frameworks)
    assert runs == TENSORFLOW_SCHEDULES


def test_docs_compatibility_page_is_current():
    page = (ROOT / "docs" / "compatibility.md").read_text()
    assert page == markdown(), "regenerate: python -m hvdtrain.strategies > docs/compatibility.md"


def test_the_table_imports_no_config_framework_or_feature():
    # The table is read by the config: it must not import the config, a framework or a feature.
    import ast

    for module in ("base", "table", "ring", "ps", "pipeline", "shard"):
        tree = ast.parse((ROOT / "hvdtrain" / "strategies" / f"{module}.py").read_text())
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        allowed = {"__future__", "copy", "collections.abc", "dataclasses", "typing",
                   "hvdtrain.errors", "hvdtrain.registry", "hvdtrain.strategies",
                   "hvdtrain.strategies.base"}
        assert names <= allowed, (module, names - allowed)


KINDS = {"dense": {}, "compressing": {"comm.compression": "topk"},
         "ps": {"comm.topology": "ps"},
         "ps-optimizer": {"comm.topology": "ps", "ps.consistency": "asp"},
         "sharded": {"shard.stage": 1}}
"""A config of each kind of exchange, as dotted settings of the digits config."""


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_exchange_is_a_look_up_or_the_tables_refusal(kind, stages, framework):
    """Each kind's factory for each framework (whole model, or a stage's) names a real function,
    or the framework cannot build it and the table refuses that config with its one line (or the
    strategy's own engine builds it)."""
    settings = {**KINDS[kind], "framework": framework, "pipeline.stages": stages}
    cfg = with_settings(load_config(CONFIG, environ={}), settings)
    assert exchange_kind(cfg) == kind
    role = framework if stages == 1 else f"{framework}.stage"
    path = exchange_of(cfg).factories.get(role)
    if path is not None:
        assert exchange_path(cfg, stage=stages > 1) == path
        module, _, name = path.partition(":")
        source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
        assert f"\ndef {name}(" in source  # a real function, without importing the framework
        return
    reason = refusal(cfg)
    if reason is None:  # TensorFlow's sharded engine builds its exchange itself
        assert engine_path(cfg) == "hvdtrain.tensorflow.shard:ShardedEngine"
        return
    with pytest.raises(ConfigError) as err:
        exchange_path(cfg, stage=stages > 1)
    assert str(err.value) == reason == _error(settings)


def test_each_strategy_names_its_checkpoint_layout_and_cost():
    for name in STRATEGIES:
        found = strategy(name)
        assert found.checkpoint is not None and found.checkpoint.files in (WHOLE, STAGE_PARTS)
        module, _, function = found.cost.partition(":")
        source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
        assert f"\ndef {function}(" in source
    assert strategy("pipeline").checkpoint.files == STAGE_PARTS  # type: ignore[union-attr]
