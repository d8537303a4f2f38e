"""TensorFlow pipeline stages under horovodrun (Gloo and MPI): the parameters after an epoch equal
one process's on the global batch, for gpipe and 1f1b, at 2 stages x 2 copies (-np 4) and 2 stages
x 1 copy (-np 2).

Digits' 1,437 training samples in steps of 16 (a copy's 8, in 4 micro-batches of 2) leave a last
step of 13: the last micro-batch holds one sample of copy 0 and none of copy 1, whose stages then
run three micro-batches to copy 0's four. Several trainings share each launch: TensorFlow's
start-up is most of a launch's time.

`make test` runs the one-process reference and MPI's -np 4 launch (1f1b with a split by index,
qsgd and gpipe: a stage's average in a process set of 2 copies); Gloo's -np 4 launches and the
-np 2 launches are `long` (`make test-long`). TensorFlow's stages train under Gloo in make test
in test_pipeline_checkpoint.py and test_pipeline_tf_compression.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from hvdtrain.compression import make_plan
from hvdtrain.config import load_config
from tests.conftest import TF_CONFIG, read_jsonl
from tests.multirank.conftest import Launch, launch_worker

COMMON = ("model.options.hidden=[32],optim.lr=0.05,optim.scale_lr=false,optim.warmup_steps=0,"
          "train.epochs=1,checkpoint.enabled=false,checkpoint.every_steps=0,data.batch_size={b}")
PIPE = COMMON + ",pipeline.stages=2,pipeline.microbatches=4,pipeline.schedule={s}"
NP4 = {"gpipe": PIPE.format(b=8, s="gpipe"),
       "1f1b": PIPE.format(b=8, s="1f1b") + ",pipeline.split=[2]",  # by index: shapes by message
       # qsgd from the first step (no dense start): every step's bytes are the plan's
       "qsgd": PIPE.format(b=8, s="1f1b") + ",comm.compression=qsgd,comm.dense_steps=0"}
NP2 = {"gpipe": PIPE.format(b=16, s="gpipe"), "1f1b": PIPE.format(b=16, s="1f1b")}
LONG = pytest.mark.long
# The launches: per (np, controller), groups of runs, each group one launch.
GROUPS = {(1, "gloo"): [["one"]], (4, "gloo"): [["gpipe", "1f1b"], ["qsgd"]],
          (4, "mpi"): [["1f1b", "qsgd", "gpipe"]],
          (2, "gloo"): [["gpipe", "1f1b"]], (2, "mpi"): [["gpipe", "1f1b"]]}
CONTROLLERS = [pytest.param("gloo", marks=LONG), "mpi"]  # of qsgd
# (controller, np, run): MPI's -np 4 in `make test`, the rest `long`.
MATRIX = [("mpi", 4, "1f1b"), ("mpi", 4, "gpipe")] + [
    pytest.param(c, n, r, marks=LONG) for c, n, r in
    [("gloo", 4, "gpipe"), ("gloo", 4, "1f1b"), ("gloo", 2, "gpipe"), ("gloo", 2, "1f1b"),
     ("mpi", 2, "gpipe"), ("mpi", 2, "1f1b")]]
# A test's first launch trains up to three epochs at -np 4 (about 4 minutes under Gloo on 2 busy
# cores, more under MPI) after the one-process reference.
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """``launches(np, controller, run)``: the launch (of :data:`GROUPS`) that trains ``run``, on
    first use; ``run`` "one" is the one-process reference."""
    cache: dict[tuple[int, str, int], Launch] = {}

    def get(np_: int, controller: str, run: str) -> Launch:
        group = next(n for n, runs in enumerate(GROUPS[np_, controller]) if run in runs)
        if (np_, controller, group) not in cache:
            out = tmp_path_factory.mktemp(f"pipe-np{np_}-{controller}-{group}")
            runs = {1: {"one": COMMON.format(b=16)}, 4: NP4, 2: NP2}[np_]
            cache[np_, controller, group] = launch_worker(
                np_, controller, "tensorflow", out,
                [f"{k}:{runs[k]}" for k in GROUPS[np_, controller][group]])
        return cache[np_, controller, group]

    return get


def stage_params(launch: Launch, run: str, ranks: list[int]) -> list[np.ndarray]:
    """The pipeline's parameters held by ``ranks`` (one copy's stages), in global layer order."""
    named = {}
    for rank in ranks:
        named |= launch.rank(run, rank)[0]
    order = sorted(named, key=lambda name: tuple(int(p) for p in name.split(".")[:2]))
    return [named[k] for k in order]


def reference(launches) -> tuple[list[np.ndarray], dict]:
    one = launches(1, "gloo", "one")
    params, record = one.rank("one", 0)
    return [params[k] for k in sorted(params, key=lambda n: int(n.split(".")[0]))], record


@pytest.mark.parametrize(("controller", "np_", "run"), MATRIX)
def test_stages_train_as_one_process_on_the_global_batch(launches, controller, np_, run):
    expected, one = reference(launches)
    launch = launches(np_, controller, run)
    copies = [[0, 1], [2, 3]] if np_ == 4 else [[0, 1]]
    got = stage_params(launch, run, copies[0])
    assert [p.shape for p in got] == [p.shape for p in expected]
    for mine, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=2e-6)
    for other in copies[1:]:  # the copies hold identical stages
        for mine, theirs in zip(stage_params(launch, run, other), got, strict=True):
            assert np.array_equal(mine, theirs)
    summary = launch.summary(run)
    assert summary["steps"] == one["summary"]["steps"] == 90
    for key in ("eval_loss", "eval_accuracy", "train_loss"):
        assert summary["final"][key] == pytest.approx(one["summary"]["final"][key], rel=1e-4), key


def test_each_stage_reports_its_compute_wait_and_memory_and_the_bubble_is_measured(launches):
    """MPI's -np 4 launch: the train records carry both stages' figures and the measured bubble
    (timings: only their ranges are checked)."""
    records = [r for r in read_jsonl(launches(4, "mpi", "1f1b").out / "1f1b" / "metrics.jsonl")
               if "step_time_median_s" in r]
    assert records
    for record in records:
        assert 0 <= record["bubble_fraction"] < 1
        for stage in (0, 1):
            assert record[f"stage_compute_s_stage{stage}"] > 0
            assert record[f"stage_wait_s_stage{stage}"] >= 0
            assert record[f"stage_rss_mb_stage{stage}"] > 0


def qsgd_bytes(launch: Launch, rank: int) -> tuple[int, int]:
    """The bytes a step's exchange hands to Horovod on ``rank`` by the compression plan of its
    stage's gradients (``comm.compression: qsgd`` at the config's ``min_size`` and ``bucket``),
    and the float32 bytes they stand for."""
    cfg = load_config(TF_CONFIG, NP4["qsgd"].split(","), environ={})
    plan = make_plan(cfg.comm, cfg.seed, [p.shape for p in launch.rank("qsgd", rank)[0].values()])
    return plan.wire_bytes(), plan.dense_bytes()


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_compression_runs_within_each_stage_group(launches, controller):
    _, one = reference(launches)
    launch = launches(4, controller, "qsgd")
    summary = launch.summary("qsgd")
    # qsgd rounds stochastically: it trains, close to the uncompressed result, not equal to it.
    assert summary["final"]["eval_accuracy"] >= one["summary"]["final"]["eval_accuracy"] - 0.05
    for a, b in zip(stage_params(launch, "qsgd", [0, 1]), stage_params(launch, "qsgd", [2, 3]),
                    strict=True):
        assert np.array_equal(a, b)
    # What each stage sends: fc1's kernel (2,048 elements, over min_size) as a byte a value and a
    # float32 scale per bucket of 512 (2,064 bytes), its bias dense (128); the head's 330
    # parameters, all under min_size, dense (1,320). A record is the mean over the 4 ranks.
    per_rank = [qsgd_bytes(launch, rank) for rank in range(4)]
    assert per_rank[0] == per_rank[2] == (2064 + 128, 4 * 2080)
    assert per_rank[1] == per_rank[3] == (1320, 1320)
    logged = [r for r in read_jsonl(launch.out / "qsgd" / "metrics.jsonl") if "wire_bytes" in r]
    assert logged
    for record in logged:
        assert record["wire_bytes"] == sum(w for w, _ in per_rank) / 4
        assert record["dense_bytes"] == sum(d for _, d in per_rank) / 4
