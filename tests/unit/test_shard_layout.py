"""The shards of the sharded update (``shard.stage=1``) without a framework:
Horovod's split, the map back onto parameters, the allgather's pieces, and the config's
refusals."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hvdtrain.config import load_config
from hvdtrain.errors import ConfigError
from hvdtrain.shard import (
    Segment,
    piece_bounds,
    pieces,
    round_ranges,
    segments,
    shard_bounds,
    shard_sizes,
)

MLP = [64 * 128, 128, 128 * 10, 10]
"""The digits MLP's parameters (9,610 elements)."""


@pytest.mark.parametrize(("total", "size"), [(9610, 1), (9610, 2), (9610, 3), (9610, 4), (5, 8)])
def test_shards_split_as_horovod_does_and_cover_the_vector_once(total, size):
    sizes = shard_sizes(total, size)
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the first ranks get the extra elements
    bounds = [shard_bounds(total, size, r) for r in range(size)]
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))


def test_three_ranks_split_the_digits_mlp_as_reducescatter():
    assert shard_sizes(9610, 3) == [3204, 3203, 3203]
    assert shard_bounds(9610, 3, 1) == (3204, 6407)


def test_segments_map_a_flat_range_onto_the_parameters():
    params = [np.arange(n) + sum(MLP[:i]) for i, n in enumerate(MLP)]  # element = flat index
    start, stop = shard_bounds(sum(MLP), 3, 2)  # (6407, 9610): the tail of 0, then 1, 2, 3
    segs = segments(MLP, start, stop)
    assert [s.param for s in segs] == [0, 1, 2, 3]
    assert segs[0].offset == 6407 and segs[0].length == 8192 - 6407
    assert sum(s.length for s in segs) == stop - start
    for s in segs:
        assert params[s.param][s.offset] == s.flat
    assert segments(MLP, 8192, 8320) == [Segment(param=1, offset=0, flat=8192, length=128)]
    assert segments(MLP, 100, 100) == []


def test_pieces_bring_every_shard_back_within_the_chunk():
    assert pieces(9610, 2, 2048) == 3  # shards of 4,805: 2048 + 2048 + 709
    assert pieces(9610, 2, 1 << 20) == 1 and pieces(0, 2, 16) == 1
    sizes = shard_sizes(9, 2)  # 5 and 4, in pieces of 4: the second rank's last round is empty
    assert pieces(9, 2, 4) == 2
    assert [piece_bounds(sizes[1], 4, k) for k in range(2)] == [(0, 4), (4, 4)]
    assert [piece_bounds(sizes[0], 4, k) for k in range(2)] == [(0, 4), (4, 5)]


@pytest.mark.parametrize(("overrides", "message"), [
    (["elastic.enabled=true", "shard.group=node"],
     "elastic.enabled=true with shard.stage=1 and shard.group='node': a reset changes"),
    (["comm.compression=topk"], "comm.compression='topk' with shard.stage=1: the sharded update's "
                                "reduce-scatter carries none or fp16 only"),
    (["comm.compression=qsgd"], "comm.compression='qsgd' with shard.stage=1"),
    (["comm.topology=ps"], "comm.topology='ps' with shard.stage=1: the sharded update"),
    (["pipeline.stages=2", "shard.stage=2", "pipeline.schedule=interleaved_zero_bubble",
      "pipeline.virtual_stages=2"],
     "pipeline.stages=2 with shard.stage=2 and pipeline.schedule='interleaved_zero_bubble'"),
])
def test_the_sharded_update_refuses_what_it_cannot_run(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["shard.stage=1", *overrides], environ={})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_elastic_mode_re_shards_every_stage_in_both_frameworks(framework, stage):
    cfg = load_config(None, [f"shard.stage={stage}", "elastic.enabled=true",
                             f"framework={framework}"], environ={})
    assert cfg.shard.stage == stage and cfg.elastic.enabled


@pytest.mark.parametrize(("overrides", "message"), [
    (["comm.topology=ps", "ps.placement=colocated"],
     "ps.placement='colocated' is gone: the sharded update is sharded data parallel now; set "
     "shard.stage=1"),
    (["shard.chunk_kib=8"], "shard.chunk_kib=8 does nothing with shard.stage=0"),
    (["shard.stage=2", "shard.chunk_kib=8"],
     "shard.chunk_kib=8 does nothing with shard.stage=2: only stage 1's rounds read it"),
    (["shard.stage=2", "shard.prefetch=2"],
     "shard.prefetch=2 does nothing with shard.stage=2: only stage 3 gathers parameters"),
    (["shard.stage=1", "shard.reshard_after_forward=false"],
     "shard.reshard_after_forward=false does nothing with shard.stage=1"),
    (["shard.unit_kib=4"], "shard.unit_kib=4 does nothing with shard.stage=0: units are cut"),
])
def test_the_old_key_and_what_does_nothing_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides, environ={})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_the_sharded_update_is_accepted_in_both_frameworks(framework):
    cfg = load_config(None, [f"framework={framework}", "shard.stage=1", "train.precision=bf16",
                             "comm.compression=fp16", "shard.chunk_kib=8"], environ={})
    assert (cfg.shard.stage, cfg.shard.chunk_kib, cfg.comm.topology) == (1, 8, "ring")


@pytest.mark.parametrize(("framework", "stage"), [("torch", 1), ("torch", 2), ("torch", 3),
                                                  ("tensorflow", 1), ("tensorflow", 2),
                                                  ("tensorflow", 3)])
def test_fp16_loss_scaling_is_accepted_at_every_built_stage(framework, stage):
    cfg = load_config(None, [f"framework={framework}", f"shard.stage={stage}",
                             "train.precision=fp16"], environ={})
    assert (cfg.shard.stage, cfg.train.precision) == (stage, "fp16")


def test_stages_two_and_three_take_their_keys_in_pytorch():
    cfg = load_config(None, ["shard.stage=3", "shard.prefetch=2", "shard.unit_kib=16",
                             "shard.reshard_after_forward=false",
                             "model.activation_checkpointing=true"], environ={})
    assert (cfg.shard.stage, cfg.shard.prefetch, cfg.shard.unit_kib) == (3, 2, 16)
    assert not cfg.shard.reshard_after_forward and cfg.model.activation_checkpointing
    assert load_config(None, ["model.activation_checkpointing=true", "shard.unit_kib=16"],
                       environ={}).shard.unit_kib == 16


@pytest.mark.parametrize(("total", "size", "chunk"), [
    (9610, 2, 2048), (9610, 3, 2048), (9610, 4, 1000), (9, 2, 4), (5, 8, 1), (4097, 4, 1024)])
def test_each_round_splits_as_reducescatter_hands_each_rank_its_piece(total, size, chunk):
    covered = []
    for k in range(pieces(total, size, chunk)):
        ranges = round_ranges(total, size, chunk, k)
        lengths = [hi - lo for lo, hi in ranges]
        assert lengths == shard_sizes(sum(lengths), size)  # Horovod's split of the round
        assert all(0 < n <= chunk for n in lengths[:1])
        covered += [i for lo, hi in ranges for i in range(lo, hi)]
    assert sorted(covered) == list(range(total))  # every element in exactly one round
    for r in range(size):  # each rank's pieces lie inside its shard, in order
        start, stop = shard_bounds(total, size, r)
        mine = [round_ranges(total, size, chunk, k)[r] for k in range(pieces(total, size, chunk))]
        assert mine[0][0] == start and mine[-1][1] == stop
