"""Sharding within a node, replicas across nodes (``shard.group=node``, PyTorch): at stages 1 and
3 a run trains as the ring does on the same global batch (Adam with weight decay), and only each
shard's gradient leaves a node.

Four ranks as two "nodes" of two under Gloo: ``horovodrun -H localhost:2,127.0.0.1:2`` gives
ranks 0-1 local size 2 on node 0 and ranks 2-3 on node 1 (Horovod's ``local_rank``,
``local_size`` and ``cross_rank``), so the shard groups are [0, 1] and [2, 3] and the replica
sets [0, 2] and [1, 3]. One launch: stages 1 and 3 hybrid, then the ring (the hybrid runs come
first: Horovod starts with the dynamic process sets they need). Stage 2, the checkpoint round trip,
fp16 on the wire, one node and uneven nodes are marked ``long``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import BIN, CONFIG, ROOT, read_jsonl, run_env
from tests.multirank.conftest import PYTHON, WORKER, Launch

ADAM = ("data.batch_size=16,train.backward_passes_per_step=2,train.max_steps=12,"
        "optim.warmup_steps=0,optim.name=adam,optim.lr=0.002,optim.weight_decay=0.01,"
        "checkpoint.every_steps=6")
SGD = ("data.batch_size=16,train.backward_passes_per_step=2,train.max_steps=12,"
       "optim.warmup_steps=0,optim.lr=0.05")
CLIP = SGD + ",optim.clip_norm=0.3"
"""SGD with momentum, the gradient clipped to a global norm of 0.3 (the MLP's starts near 2)."""
NODE = "shard.group=node"
PARAMETERS = 64 * 128 + 128 + 128 * 10 + 10
"""The digits MLP's parameters (9,610): a node's two ranks hold 4,805 each."""
TOLERANCE = 1e-5
"""Each node averages its ranks, then the nodes their averages, where the ring averages all four
(float32 sums in another order: seen below 1e-7 after 12 Adam steps)."""
HOSTS = "localhost:2,127.0.0.1:2"


def launch(argv: list[str], hosts: str = HOSTS, np_: int = 4) -> subprocess.CompletedProcess:
    """``argv`` at ``np_`` ranks on the "hosts" of one machine, under Gloo."""
    cmd = [str(BIN / "horovodrun"), "-np", str(np_), "-H", hosts, "--gloo", *argv]
    return subprocess.run(cmd, cwd=ROOT, env=run_env(), capture_output=True, text=True,
                          timeout=900)


def two_nodes(out: Path, runs: list[str], hosts: str = HOSTS, np_: int = 4) -> Launch:
    """The worker at 4 ranks on two "hosts" of one machine, 2 ranks each (or ``hosts``)."""
    proc = launch([PYTHON, WORKER, str(out), str(CONFIG), *runs], hosts, np_)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Launch("torch", "gloo", out)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> Launch:
    out = tmp_path_factory.mktemp("shard-hybrid")
    return two_nodes(out, [f"h1:{ADAM},shard.stage=1,{NODE}", f"h3:{ADAM},shard.stage=3,{NODE}",
                           f"ring:{ADAM}"])


def ranks_agree(launch: Launch, run: str) -> dict[str, np.ndarray]:
    first = launch.rank(run, 0)[0]
    for r in (1, 2, 3):  # every rank ends with the whole model: gathered within its node
        other = launch.rank(run, r)[0]
        for key in first:
            assert np.array_equal(first[key], other[key]), f"{run}: rank {r} against 0 at {key}"
    return first


def assert_near(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert got.keys() == want.keys() and len(got) == 4, what
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=TOLERANCE, rtol=0, err_msg=what)


def test_stages_one_and_three_within_a_node_train_as_the_ring(hybrid):
    ring = hybrid.rank("ring", 0)[0]
    start = hybrid.rank("ring", 0)[1]["summary"]
    assert start["world_size"] == 4
    for run, stage in (("h1", 1), ("h3", 3)):
        assert_near(ranks_agree(hybrid, run), ring, f"stage {stage} within a node")
        summary = hybrid.summary(run)
        assert (summary["shard_stage"], summary["shard_group"], summary["shard_ranks"]) == (
            stage, "node", 2)
    # Far from the start: the steps moved the weights by more than the tolerance.
    assert all(r["step"] <= 12 for r in read_jsonl(hybrid.out / "ring" / "metrics.jsonl"))


def test_only_each_shard_leaves_the_node(hybrid):
    """Per step (2 micro-batches): stage 1 reduce-scatters the whole gradient once and
    all-gathers its shard within the node, then allreduces the shard (4,805 floats) across the
    nodes; stage 3 reduce-scatters each micro-batch's gradient and gathers the shards before
    each forward and backward pass within the node, and allreduces the shards' sum across nodes
    once a step. So what leaves the node is half a gradient (the shard), where with
    shard.group=all every collective spans both nodes."""
    own = PARAMETERS // 2
    for run, within in (("h1", 4 * PARAMETERS + 4 * own), ("h3", 8 * PARAMETERS + 16 * own)):
        logged = [r for r in read_jsonl(hybrid.out / run / "metrics.jsonl") if "wire_bytes" in r]
        assert logged, run
        assert {r["cross_node_bytes"] for r in logged} == {4 * own}, run
        assert {r["wire_bytes"] for r in logged} == {within + 4 * own}, run
    ring = [r for r in read_jsonl(hybrid.out / "ring" / "metrics.jsonl") if "wire_bytes" in r]
    assert ring and all("cross_node_bytes" not in r for r in ring)


@pytest.mark.long
def test_stage_two_fp16_and_checkpoints_within_a_node(tmp_path_factory):
    """Stage 2 within a node against the ring; fp16 on the wire near it; stage 3 within a node
    resumed from the ring's step-6 checkpoint, and the ring from stage 3's (every rank wrote its
    shards, the second node the same shards again); stages 1 and 3 clipped by the global norm
    (summed over a node's shards) as the ring clips."""
    out = tmp_path_factory.mktemp("shard-hybrid-long")
    ckpt = out / "{}" / "checkpoints" / "step-00000006.ckpt"
    launch = two_nodes(out, [
        f"h2:{ADAM},shard.stage=2,{NODE}", f"h2_fp16:{ADAM},shard.stage=2,{NODE},"
        "comm.compression=fp16", f"h3:{ADAM},shard.stage=3,{NODE}", f"ring:{ADAM}",
        f"h3_from_ring:{ADAM},shard.stage=3,{NODE},checkpoint.resume={str(ckpt).format('ring')}",
        f"ring_from_h3:{ADAM},checkpoint.resume={str(ckpt).format('h3')}",
        f"h1_clip:{CLIP},shard.stage=1,{NODE}", f"h3_clip:{CLIP},shard.stage=3,{NODE}",
        f"ring_clip:{CLIP}", f"sgd:{SGD}"])
    ring = launch.rank("ring", 0)[0]
    assert_near(ranks_agree(launch, "h2"), ring, "stage 2 within a node")
    assert_near(ranks_agree(launch, "h3_from_ring"), ring, "stage 3 from a ring checkpoint")
    assert_near(launch.rank("ring_from_h3", 0)[0], ring, "the ring from a stage-3 checkpoint")
    fp16 = ranks_agree(launch, "h2_fp16")
    for key in ring:  # float16 on the wire: near, not equal
        np.testing.assert_allclose(fp16[key], ring[key], atol=1e-2, rtol=0)
    logged = [r for r in read_jsonl(out / "h2_fp16" / "metrics.jsonl") if "wire_bytes" in r]
    assert logged and {r["cross_node_bytes"] for r in logged} == {2 * (PARAMETERS // 2)}
    clipped = launch.rank("ring_clip", 0)[0]
    assert not np.allclose(clipped["1.weight"], launch.rank("sgd", 0)[0]["1.weight"], atol=1e-3)
    for run in ("h1_clip", "h3_clip"):
        assert_near(ranks_agree(launch, run), clipped, f"{run} against the clipped ring")


@pytest.mark.long
def test_one_node_is_sharding_over_all_and_uneven_nodes_are_refused(tmp_path_factory):
    """On one node shard.group=node is shard.group=all (2 ranks on one host: equal to the
    bit); nodes of 3 and 1 ranks stop the run at its start with one line."""
    out = tmp_path_factory.mktemp("shard-hybrid-one-node")
    one = two_nodes(out, [f"node:{ADAM},shard.stage=3,{NODE}", f"all:{ADAM},shard.stage=3"],
                    hosts="localhost:2", np_=2)
    node, every = one.rank("node", 0)[0], one.rank("all", 0)[0]
    assert node.keys() == every.keys() and all(np.array_equal(node[k], every[k]) for k in node)
    assert one.summary("node")["shard_ranks"] == 2
    proc = launch([str(BIN / "hvdtrain"), "train", str(CONFIG), "shard.stage=1", NODE,
                   "train.max_steps=1", f"log.dir={out / 'uneven'}"], hosts="localhost:3,127.0.0.1:1")
    assert proc.returncode != 0
    assert ("shard.group=node with [1, 3] ranks on different nodes: launch the same number of "
            "ranks on every node, or use shard.group=all") in proc.stdout + proc.stderr
