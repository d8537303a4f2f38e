"""The framework-free pipeline core: the split of the layer list, and the
config checks that stop an impossible pipeline before anything starts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hvdtrain.config import load_config
from hvdtrain.errors import ConfigError
from hvdtrain.pipeline import SCHEDULES, balanced_bounds, microbatch_count, stage_bounds
from hvdtrain.pipeline.split import explicit_bounds, layer_names
from hvdtrain.pipeline.state import merge_parts, misfit, select_part


@pytest.mark.parametrize("costs, pieces, bounds", [
    ([1, 1, 1, 1], 2, [0, 2, 4]),
    ([8, 0, 8, 0, 1], 2, [0, 2, 5]),         # the mlp: Linear, ReLU, Linear, ReLU, Linear
    ([10, 1, 1, 1, 1, 1], 2, [0, 1, 6]),
    ([5, 5, 5], 3, [0, 1, 2, 3]),
    ([0, 0, 0, 9], 2, [0, 3, 4]),
    ([3, 1, 4, 1, 5, 9, 2, 6], 3, [0, 5, 7, 8]),  # 14, 11, 6: earlier pieces take more
    ([7], 1, [0, 1]),
])
def test_balanced_bounds(costs, pieces, bounds):
    assert balanced_bounds(costs, pieces) == bounds


@pytest.mark.parametrize("costs, pieces", [([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], k) for k in (1, 2, 3, 4, 5)])
def test_balanced_bounds_are_optimal_by_brute_force(costs, pieces):
    n = len(costs)
    got = balanced_bounds(costs, pieces)
    assert got[0] == 0 and got[-1] == n and all(a < b for a, b in itertools.pairwise(got))

    def worst(bounds):
        return max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))

    best = min(worst([0, *cut, n]) for cut in itertools.combinations(range(1, n), pieces - 1))
    assert worst(got) == best


def test_explicit_bounds_by_index_and_name():
    names = ["embed", "block0", "block1", "block2", "head"]
    assert explicit_bounds([2], names, 2) == [0, 2, 5]
    assert explicit_bounds(["block1", 4], names, 3) == [0, 2, 4, 5]
    assert stage_bounds("auto", [1, 1, 1, 1, 1], names, 5) == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("split, pieces, message", [
    ([0], 2, "layer index 0 must lie in 1..4"),
    ([5], 2, "layer index 5 must lie in 1..4"),
    (["nope"], 2, "no layer named 'nope'; the layers: embed, block0"),
    ([3, 2], 3, "the layers must be increasing"),
    ([2, 2], 3, "the layers must be increasing"),
    ([1, 2, 3], 3, "3 pieces need 2 layer(s)"),
])
def test_explicit_bounds_refusals(split, pieces, message):
    names = ["embed", "block0", "block1", "block2", "head"]
    with pytest.raises(ConfigError) as err:
        explicit_bounds(split, names, pieces)
    assert message in str(err.value)


def test_too_few_layers_for_the_pieces():
    with pytest.raises(ConfigError, match="the model has 2 layers: too few for 3 pipeline pieces"):
        stage_bounds("auto", [1, 1], ["a", "b"], 3)


def test_layer_names_from_factories():
    class Named:
        name = "embed"

    assert layer_names([Named(), lambda: None]) == ["embed", "1"]


def test_pieces_of_each_style():
    assert SCHEDULES["1f1b"].pieces_of(1, 4, 1) == [1]
    assert SCHEDULES["interleaved_1f1b"].pieces_of(1, 4, 2) == [1, 5]
    assert SCHEDULES["zbv_zero_bubble"].pieces_of(1, 4, 2) == [1, 6]
    every = sorted(p for r in range(3) for p in SCHEDULES["dualpipev"].pieces_of(r, 3, 2))
    assert every == list(range(6))
    for name, v in (("1f1b", 1), ("interleaved_1f1b", 3), ("dualpipev", 2)):
        schedule = SCHEDULES[name]
        for rank in range(3):
            assert all(schedule.holder(p, 3) == rank for p in schedule.pieces_of(rank, 3, v))
    assert SCHEDULES["zbv_zero_bubble"].holder(3, 2) == 0  # the V: the last piece is on rank 0


def test_bubble_formulas():
    assert SCHEDULES["gpipe"].bubble(4, 8) == pytest.approx(3 / 11)
    assert SCHEDULES["interleaved_1f1b"].bubble(4, 8, 2) == pytest.approx(3 / 19)


def test_microbatches_default_to_one_per_piece():
    assert microbatch_count(4, 0, 2) == 8
    assert microbatch_count(4, 6, 1) == 6
    cfg = load_config(None, ["pipeline.stages=2"], environ={})
    assert cfg.pipeline.microbatches == 0 and cfg.pipeline.schedule == "1f1b"


@pytest.mark.parametrize("overrides, message", [
    (["pipeline.stages=2", "pipeline.microbatches=1"],
     "pipeline.microbatches=1: schedule 1f1b needs at least 2 with 2 stages"),
    (["pipeline.stages=2", "pipeline.schedule=interleaved_zero_bubble",
      "pipeline.virtual_stages=2", "pipeline.microbatches=5"],
     "pipeline.microbatches=5: schedule interleaved_zero_bubble needs a multiple of its rounds"),
    (["pipeline.stages=2", "pipeline.schedule=dualpipev", "pipeline.virtual_stages=2",
      "pipeline.microbatches=4"], "pipeline.schedule='dualpipev': torch.distributed.pipelining"),
    (["pipeline.stages=2", "pipeline.schedule=zbv_zero_bubble", "pipeline.virtual_stages=2"],
     "pipeline.schedule='zbv_zero_bubble': torch.distributed.pipelining 2.13 cannot evaluate"),
    (["pipeline.stages=4", "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2",
      "pipeline.microbatches=9"],
     "pipeline.microbatches=9: schedule interleaved_1f1b needs a multiple of its rounds"),
    (["pipeline.stages=2", "pipeline.schedule=interleaved_1f1b"],
     "pipeline.virtual_stages=1: schedule interleaved_1f1b needs at least 2 model pieces"),
    (["pipeline.stages=2", "pipeline.schedule=zbv_zero_bubble", "pipeline.virtual_stages=3"],
     "schedule zbv_zero_bubble needs exactly 2 model pieces per rank"),
    (["pipeline.stages=2", "pipeline.virtual_stages=2"],
     "pipeline.virtual_stages=2: schedule 1f1b needs exactly 1"),
    (["pipeline.stages=2", "framework=tensorflow", "pipeline.schedule=dualpipev",
      "pipeline.virtual_stages=2"],
     "pipeline.schedule='dualpipev': runs with PyTorch only; with tensorflow use one of gpipe"),
    (["pipeline.stages=2", "framework=tensorflow", "pipeline.schedule=interleaved_1f1b",
      "pipeline.virtual_stages=2"],
     "pipeline.schedule='interleaved_1f1b': runs with PyTorch only; with tensorflow use one of "
     "gpipe, 1f1b"),
    (["pipeline.stages=2", "pipeline.microbatches=3"],
     "data.batch_size=32: with pipeline stages it is the batch of one pipeline copy"),
    (["pipeline.stages=2", "data.eval_batch_size=9"], "data.eval_batch_size=9: with pipeline"),
    (["pipeline.stages=2", "elastic.enabled=true"],
     "elastic mode does not work with pipeline stages"),
    (["pipeline.stages=2", "train.backward_passes_per_step=2"],
     "a pipeline accumulates over pipeline.microbatches"),
    (["pipeline.stages=2", "train.precision=bf16"], "pipeline stages train in fp32 only"),
    (["pipeline.stages=2", "model.sync_batchnorm=true"], "not supported with pipeline stages"),
    (["pipeline.stages=2", "pipeline.split=[1,2]"], "2 pieces need 1 layer(s)"),
    (["pipeline.stages=2", "pipeline.split=middle"], "pipeline.split='middle': expected auto"),
    (["pipeline.stages=2", "pipeline.split=[1.5]"], "1.5 is neither a layer index nor a layer name"),
    (["pipeline.split=3"], "pipeline.split=3: expected a string or a list"),
    (["pipeline.stages=0"], "pipeline.stages=0: must be >= 1"),
])
def test_config_refuses_pipelines_that_cannot_run(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, environ={})
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides", [
    ["pipeline.stages=2"],
    ["pipeline.stages=2", "pipeline.schedule=gpipe", "pipeline.microbatches=1"],
    ["pipeline.stages=2", "pipeline.split=[fc2]"],
    ["pipeline.stages=2", "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2"],
    ["pipeline.stages=2", "pipeline.schedule=interleaved_zero_bubble",
     "pipeline.virtual_stages=2"],
    ["pipeline.stages=2", "framework=tensorflow", "pipeline.schedule=gpipe"],
    ["pipeline.stages=2", "comm.compression=topk", "comm.momentum_correction=true"],
    ["pipeline.stages=2", "comm.compression=powersgd"],
    ["elastic.enabled=true", "train.precision=bf16"],  # no stages: nothing is refused
])
def test_config_accepts_pipelines_that_can_run(overrides):
    load_config(None, overrides, environ={})


def _part(layers: dict[int, list[str]], step: int) -> dict:
    """A stage's share: each layer's entries, and optimizer state for each parameter."""
    model = {f"{i}.{n}": np.full(2, i + 0.5) for i, names in layers.items() for n in names}
    params = [k for k in model if not k.endswith("running_mean")]
    return {"model": model, "params": params,
            "optimizer": {"state": {j: {"momentum": np.full(2, j + 10 * step)} for j in
                                    range(len(params))},
                          "param_groups": [{"lr": 0.1, "momentum": 0.9,
                                            "params": list(range(len(params)))}]}}


def test_merged_parts_are_the_whole_model_and_cut_back_into_any_split():
    layers = {0: ["weight", "bias"], 1: ["weight", "running_mean"], 2: ["weight"]}
    all_params = ["0.weight", "0.bias", "1.weight", "2.weight"]
    all_keys = ["0.weight", "0.bias", "1.weight", "1.running_mean", "2.weight"]
    # Parts arrive in any order: the later piece first.
    second, first = _part({2: layers[2]}, 1), _part({0: layers[0], 1: layers[1]}, 0)
    model, optimizer = merge_parts([second, first], all_params)
    assert list(model) == all_keys
    assert misfit(model.keys(), optimizer, all_keys, all_params) is None
    momenta = {i: float(s["momentum"][0]) for i, s in optimizer["state"].items()}
    assert momenta == {0: 0.0, 1: 1.0, 2: 2.0, 3: 10.0}
    assert optimizer["param_groups"] == [{"lr": 0.1, "momentum": 0.9, "params": [0, 1, 2, 3]}]
    # Another split: layer 0 alone, then layers 1 and 2.
    part_model, part_opt = select_part(model, optimizer, all_params, ["1.weight", "2.weight"],
                                       {1, 2})
    assert list(part_model) == ["1.weight", "1.running_mean", "2.weight"]
    assert {i: float(s["momentum"][0]) for i, s in part_opt["state"].items()} == {0: 2.0, 1: 10.0}
    assert part_opt["param_groups"][0]["params"] == [0, 1]


def test_a_checkpoint_of_another_model_does_not_fit():
    all_params, all_keys = ["0.weight"], ["0.weight", "0.bias"]
    optimizer = {"state": {}, "param_groups": [{"params": [0]}]}
    assert "1 model entries missing" in misfit(["0.weight"], optimizer, all_keys, all_params)
    assert "not of one group" in misfit(all_keys, {"state": {}, "param_groups": []}, all_keys,
                                        all_params)
    assert misfit(all_keys, optimizer, all_keys, all_params) is None


def test_parameter_servers_are_refused_with_pipeline_stages():
    with pytest.raises(ConfigError, match=r"comm.topology='ps' with pipeline.stages=2: .*need "
                                          r"pipeline.stages=1"):
        load_config(None, ["pipeline.stages=2", "comm.topology=ps"], environ={})
