"""The layout of ranks (hvdtrain/layout.py), without a framework: servers, pipeline stages,
data-parallel copies and the shard dimension, each rank's coordinates and the groups that talk."""

from __future__ import annotations

import itertools

import pytest

from hvdtrain.config import load_config
from hvdtrain.errors import ConfigError, HvdtrainError
from hvdtrain.layout import SERVER, WORKER, Coordinates, Layout, check_nodes, dedicated


def test_layout_of_two_stages_by_two_copies():
    layout = Layout(size=4, stages=2)
    assert layout.copies == 2
    assert layout.pipelines() == [[0, 1], [2, 3]]
    assert layout.stage_groups() == [[0, 2], [1, 3]]
    assert [(layout.stage_of(r), layout.copy_of(r)) for r in range(4)] == [(0, 0), (1, 0), (0, 1),
                                                                          (1, 1)]
    assert [layout.loads_data(r) for r in range(4)] == [True] * 4
    assert layout.is_first(2) and layout.is_last(3) and not layout.is_last(0)


@pytest.mark.parametrize("size, stages", [(1, 1), (4, 1), (4, 4), (6, 3), (12, 4), (8, 2)])
def test_layout_partitions_the_world_both_ways(size, stages):
    layout = Layout(size, stages)
    for groups in (layout.pipelines(), layout.stage_groups()):
        assert sorted(itertools.chain(*groups)) == list(range(size))
    for rank in range(size):
        stage, copy = layout.stage_of(rank), layout.copy_of(rank)
        assert layout.rank_of(stage, copy) == rank
        assert rank in layout.pipeline_ranks(copy) and rank in layout.stage_ranks(stage)
    assert layout.rank_of(0, 0) == 0
    middle = [r for r in range(size) if not layout.loads_data(r)]
    assert len(middle) == max(0, stages - 2) * (size // stages)


def test_layout_refuses_a_world_the_stages_do_not_divide():
    with pytest.raises(ConfigError, match=r"pipeline.stages=3 does not divide the world size 4"):
        Layout(4, 3)
    with pytest.raises(ValueError, match="rank 4 outside"):
        Layout(4, 2).stage_of(4)


LAYOUTS = [Layout(1), Layout(4), Layout(4, stages=4), Layout(6, stages=3), Layout(12, stages=4),
           Layout(3, servers=1), Layout(5, servers=2), Layout(7, stages=2, servers=1),
           Layout(8, stages=2, servers=2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_coordinates_round_trip_every_rank(layout):
    seen = set()
    for rank in range(layout.size):
        where = layout.coordinates(rank)
        assert layout.rank_at(where) == rank
        assert where.role == layout.role(rank)
        seen.add(where)
    assert len(seen) == layout.size  # no two ranks share coordinates


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_every_worker_is_in_exactly_one_group_of_each_kind(layout):
    workers = layout.worker_ranks()
    for groups in (layout.pipelines(), layout.stage_groups(), layout.shard_groups()):
        flat = list(itertools.chain(*groups))
        assert sorted(flat) == workers and len(flat) == len(set(flat))
    assert sorted(layout.worker_ranks() + layout.server_ranks()) == list(range(layout.size))
    assert not set(layout.worker_ranks()) & set(layout.server_ranks())


def test_servers_are_the_last_ranks_and_worker_i_is_rank_i():
    layout = Layout(5, servers=2)
    assert (layout.workers, layout.copies) == (3, 3)
    assert layout.worker_ranks() == [0, 1, 2] and layout.server_ranks() == [3, 4]
    assert [layout.role(r) for r in range(5)] == [WORKER] * 3 + [SERVER] * 2
    assert layout.coordinates(4) == Coordinates(SERVER, server=1)
    assert layout.coordinates(2) == Coordinates(WORKER, stage=0, copy=2, shard=0)
    assert [layout.server_index(r) for r in (3, 4)] == [0, 1]
    assert layout.stage_groups() == [[0, 1, 2]]  # the workers' one data-parallel group
    with pytest.raises(ValueError, match="rank 3 is a server"):
        layout.stage_of(3)
    with pytest.raises(ValueError, match="rank 0 is a worker"):
        layout.server_index(0)


def test_stages_and_copies_beside_servers():
    layout = Layout(7, stages=2, servers=1)  # workers 0-5: 3 copies of 2 stages; server: rank 6
    assert layout.pipelines() == [[0, 1], [2, 3], [4, 5]]
    assert layout.stage_groups() == [[0, 2, 4], [1, 3, 5]]
    assert layout.server_ranks() == [6] and layout.describe() == "2 stages x 3 copies"
    with pytest.raises(ConfigError, match=r"pipeline.stages=2 does not divide the 5 workers"):
        Layout(6, stages=2, servers=1)


def test_a_job_of_servers_only_is_refused_as_the_launch_said():
    with pytest.raises(HvdtrainError, match=r"ps.servers=1 with 1 rank\(s\) in the job leaves no "
                                            r"worker: launch more ranks than servers \(e.g. -np 2\)"):
        Layout(1, servers=1)


def test_the_shard_dimension_is_one_unless_sharding_within_a_node():
    layout = Layout(4, stages=2)
    assert layout.shards == 1 and layout.shard_groups() == [[0], [1], [2], [3]]
    assert [layout.shard_of(r) for r in range(4)] == [0] * 4
    # shard.group=all: a rank's place is its copy among the stage's copies, no replicas.
    assert Layout(4).sharding(2) == (2, 4) and Layout(4).sharding_ranks(2) == [0, 1, 2, 3]
    assert Layout(4).replica_ranks(2) == [2]
    with pytest.raises(ValueError, match="shards=0"):
        Layout(4, shards=0)


def test_sharding_within_a_node_shards_over_its_ranks_and_replicates_across_nodes():
    layout = Layout(6, shards=3)  # two nodes of three ranks: 0-2 and 3-5
    assert layout.copies == 2 and layout.shard_groups() == [[0, 1, 2], [3, 4, 5]]
    assert layout.stage_groups() == [[0, 3], [1, 4], [2, 5]]
    assert [layout.sharding(r) for r in range(6)] == [(0, 3), (1, 3), (2, 3)] * 2
    assert layout.sharding_ranks(4) == [3, 4, 5] and layout.replica_ranks(4) == [1, 4]
    node = load_config(None, overrides=["shard.stage=3", "shard.group=node"])
    assert Layout.of(node, 6, 3) == layout and Layout.of(node, 3, 3).replica_ranks(1) == [1]
    assert Layout.of(load_config(None, overrides=["shard.stage=3"]), 6, 3).shards == 1
    with pytest.raises(ConfigError, match=r"shard\.group=node with 4 ranks a node does not "
                                          r"divide the world size 6"):
        Layout.of(node, 6, 4)


def test_sharding_within_a_node_needs_even_consecutive_nodes():
    assert check_nodes([(0, 2, 0), (1, 2, 0), (0, 2, 1), (1, 2, 1)]) == 2
    with pytest.raises(ConfigError, match=r"shard.group=node with \[1, 2\] ranks on different "
                                          "nodes: launch the same number"):
        check_nodes([(0, 2, 0), (1, 2, 0), (0, 1, 1)])
    with pytest.raises(ConfigError, match=r"one rank a node: there is nothing to shard"):
        check_nodes([(0, 1, 0), (0, 1, 1)])
    with pytest.raises(ConfigError, match="rank 1 is local rank 0 of node 1; place consecutive"):
        check_nodes([(0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)])  # round-robin placement


def test_the_layout_of_a_config_counts_dedicated_servers_on_top_of_the_workers():
    ring = load_config(None, overrides=["pipeline.stages=2"])
    assert Layout.of(ring, 4) == Layout(4, stages=2)
    ps = load_config(None, overrides=["comm.topology=ps", "ps.servers=2"])
    assert dedicated(ps) and Layout.of(ps, 3) == Layout(5, servers=2)
    sharded = load_config(None, overrides=["shard.stage=1"])
    assert not dedicated(sharded) and Layout.of(sharded, 3) == Layout(3)
    assert Layout.of(ring, 4).resized(6) == Layout(6, stages=2)


@pytest.mark.parametrize(("overrides", "message"), [
    (["shard.group=node"], "shard.group='node' does nothing with shard.stage=0: only the sharded "
                           "update has a shard group; set shard.stage=1, 2 or 3"),
    (["shard.stage=1", "shard.group=node", "framework=tensorflow"],
     "framework='tensorflow' with shard.group='node': sharding within a node is built in "
     "PyTorch only so far; use shard.group=all"),
    (["shard.stage=1", "shard.group=node", "pipeline.stages=2"],
     "pipeline.stages=2 with shard.group='node': a stage's shards within a node are not built"),
    (["shard.stage=1", "shard.group=rack"], "shard.group='rack': must be one of all, node"),
])
def test_sharding_within_a_node_refuses_what_it_cannot_run_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides, environ={})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    assert load_config(None, ["shard.stage=2", "shard.group=node"], environ={}).shard.group == "node"
