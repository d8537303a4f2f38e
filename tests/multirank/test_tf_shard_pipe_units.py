"""TensorFlow pipeline stages x sharded copies at ``shard.stage=2`` (``pipeline.stages=2``,
``horovodrun -np 4``): each micro-batch's gradient is reduce-scattered among the stage's two
copies as its backward pass ends, only the copy's shard is summed over the step, then the shard's
Adam step and the all-gather.

On the digits MLP with a hidden layer of 32 (stage 0: ``fc1``, 2,080 parameters; stage 1: the
head, 330; a unit each), Adam with L2 weight decay, 1F1B, one epoch over a training split of 337
samples (``test_fraction=0.8124``): 6 steps of a global batch of 64 (a copy's 32 in 4
micro-batches of 8), the last one short. Its 17 samples are dealt out in turn, 9 to copy 0
(micro-batches of 8 and 1) and 8 to copy 1 (one of 8): the copies have different numbers of
non-empty micro-batches, and copy 1 reduce-scatters zeros in place of its second so that the
copies' collectives pair up (without them, copy 0's second reduce-scatter waits for ever).
Asserted:

- after the epoch each copy's parameters equal one process trained on the global batch without
  stages or sharding, within 1e-5 (the copies identical), and so do the logged train losses and
  the final train and eval losses: what the zero reduce-scatters and the weighting must get right;
- every step, the short one too, hands Horovod the stage's whole gradient once per micro-batch
  and the float32 shard once: 18 bytes a stage parameter over the two copies (stage 1's: 6);
- a run resumed from step 3 ends bit-identical to the uninterrupted run.

`make test` runs Gloo's launch (the run and its resumed run) against one process. `long`: MPI's
launch, and resumes across sharding: stage 2 from stage 1's step 3 and stage 1 from stage 2's,
and a pipeline without sharding from stage 2's, each within 1e-5 of the uninterrupted run.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.data.digits import DigitsDataset
from hvdtrain.data.sampler import ShardedSampler
from tests.conftest import read_jsonl
from tests.multirank.conftest import Launch, launch_worker
from tests.multirank.test_tf_shard_pipe import assert_close, assert_copies_equal, step_losses

FRACTION = 0.8124
COMMON = (f"model.options.hidden=[32],data.options.test_fraction={FRACTION},optim.name=adam,"
          "optim.lr=0.01,optim.weight_decay=0.01,optim.scale_lr=false,optim.warmup_steps=0,"
          "train.epochs=1,log.every_steps=2,train.stall_timeout_s=120")
PIPE = ("data.batch_size=32,pipeline.stages=2,pipeline.microbatches=4,pipeline.schedule=1f1b,"
        "checkpoint.every_steps=3,checkpoint.keep=3," + COMMON)
"""2 copies of 32 samples a step: the global batch of 64, at the same rate (no scaling)."""
UNITS = PIPE + ",shard.stage=2"
SHARD3 = PIPE + ",shard.stage=3"
"""Stage 3 (test_tf_shard_pipe3.py), whose runs share this module's launches."""
FLAT = PIPE + ",shard.stage=1,shard.chunk_kib=4"
ONE = "data.batch_size=64,checkpoint.enabled=false,checkpoint.every_steps=0," + COMMON
ATOL = 1e-5  # float32 sums in another order over 6 steps; a wrong weight moves 1e-3
AT, STEPS = 3, 6
STAGE_PARAMETERS = (64 * 32 + 32, 32 * 10 + 10)
LONG = pytest.mark.long
pytestmark = pytest.mark.timeout(1500)


def resume(out: Path, run: str) -> str:
    return f"checkpoint.resume={out / run / 'checkpoints' / f'step-{AT:08d}.ckpt'}"


_LAUNCHES: dict[tuple[int, str, str], Launch] = {}
"""The launches of this pytest process, by (np, controller, group): shared with
test_tf_shard_pipe3.py, whose stage-3 runs are in them (a launch and a reference fewer)."""


def launch(tmp_path_factory, np_: int, controller: str, group: str = "main") -> Launch:
    """One launch on first use; ``np_`` 1 is the one-process reference, ``group`` "main" the
    stage-2 and stage-3 runs and their resumed runs (under MPI, whose ranks poll and so run
    slower on a loaded machine, stage 3's are "main3", a launch of their own), "cross" the
    resumes across stages 1-2 and none, "cross3" those across stages 2-3 and none and stage 3
    with GPipe keeping the forward's gathered variables (apart: a launch has 600 s)."""
    if (np_, controller, group) not in _LAUNCHES:
        out = tmp_path_factory.mktemp(f"tf-units-pipe-np{np_}-{controller}-{group}")
        if np_ == 1:
            runs = [f"one:{ONE}"]
        elif group in ("main", "main3"):
            runs = [f"units:{UNITS}", f"resumed:{UNITS},{resume(out, 'units')}"]
            stage3 = [f"shard3:{SHARD3}", f"resumed3:{SHARD3},{resume(out, 'shard3')}"]
            if controller == "mpi":
                runs = stage3 if group == "main3" else runs
            else:
                runs += stage3
        elif group == "cross":
            runs = [f"units:{UNITS}", f"flat:{FLAT}",
                    f"units_from_flat:{UNITS},{resume(out, 'flat')}",
                    f"flat_from_units:{FLAT},{resume(out, 'units')}",
                    f"plain_from_units:{PIPE},{resume(out, 'units')}"]
        else:
            runs = [f"shard3:{SHARD3}", f"units:{UNITS}",
                    f"shard3_from_units:{SHARD3},{resume(out, 'units')}",
                    f"units_from_shard3:{UNITS},{resume(out, 'shard3')}",
                    f"plain_from_shard3:{PIPE},{resume(out, 'shard3')}",
                    f"kept:{SHARD3},shard.reshard_after_forward=false,pipeline.schedule=gpipe"]
        _LAUNCHES[np_, controller, group] = launch_worker(np_, controller, "tensorflow", out,
                                                          runs)
    return _LAUNCHES[np_, controller, group]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """``launches(np, controller, group)``: :func:`launch`."""
    return functools.partial(launch, tmp_path_factory)


def reference(launches) -> tuple[list[np.ndarray], dict]:
    params, record = launches(1, "gloo").rank("one", 0)
    return [params[k] for k in sorted(params, key=lambda n: int(n.split(".")[0]))], record


def test_the_last_step_leaves_the_copies_unequal_micro_batch_counts():
    samples = len(DigitsDataset(test_fraction=FRACTION).train().y)
    assert (samples, -(-samples // 64)) == (337, STEPS)
    live = []
    for copy in range(2):
        (last,) = ShardedSampler(samples, 32, seed=0).steps(0, copy, 2).micro_batches()[-1:]
        live.append([len(last[i * 8:(i + 1) * 8]) for i in range(4)])
    assert live == [[8, 1, 0, 0], [8, 0, 0, 0]]


def check_units_launch(launches, controller: str, run: str = "units", resumed: str = "resumed",
                       group: str = "main", what: str = "stage-2") -> None:
    """The launch's ``run`` (its copies equal, one process within 1e-5, losses alike) and
    ``resumed`` from step 3 (the very bits of ``run``); stage 3 passes its own names."""
    want, one = reference(launches)
    launch = launches(4, controller, group)
    got = assert_copies_equal(launch, run)
    assert_close(got, want, f"{what} sharded stages against one process ({controller})")
    losses, ones = step_losses(launch.out, run), step_losses(launches(1, "gloo").out, "one")
    assert [s for s, _ in losses] == [s for s, _ in ones] == [2, 4, 6]
    np.testing.assert_allclose([v for _, v in losses], [v for _, v in ones], rtol=1e-5)
    summary, final = launch.summary(run), one["summary"]["final"]
    assert (summary["steps"], one["summary"]["steps"]) == (STEPS, STEPS)
    for key in ("train_loss", "eval_loss"):
        assert summary["final"][key] == pytest.approx(final[key], rel=1e-4), key
    for rank in range(4):  # resumed from step 3: the very bits of the uninterrupted run
        again, _ = launch.rank(resumed, rank)
        for key, value in launch.rank(run, rank)[0].items():
            assert np.array_equal(again[key], value), (rank, key)
    assert read_jsonl(launch.out / resumed / "metrics.jsonl")[0]["step"] == 4


@pytest.mark.parametrize("controller", ["gloo", pytest.param("mpi", marks=LONG)])
def test_stage_2_sharded_stages_train_as_one_process_and_resume_exactly(launches, controller):
    check_units_launch(launches, controller)


def test_each_step_sends_every_micro_batch_gradient_and_the_shard(launches):
    logged = [r for r in read_jsonl(launches(4, "gloo").out / "units" / "metrics.jsonl")
              if "wire_bytes" in r]
    assert [r["step"] for r in logged] == [2, 4, 6]
    # The mean over the 4 ranks: 4 micro-batches' float32 gradient and the float32 shard,
    # 16 + 2 bytes a stage parameter over the stage's two copies; the short step (6) too.
    for record in logged:
        assert record["wire_bytes"] == pytest.approx(18 * sum(STAGE_PARAMETERS) / 2, abs=4)


@LONG
def test_resumes_across_sharding_stages_agree_with_the_uninterrupted_runs(launches):
    launch = launches(4, "gloo", "cross")
    units, flat = (assert_copies_equal(launch, run) for run in ("units", "flat"))
    assert_close(flat, units, "stage 1 against stage 2")
    assert_close(assert_copies_equal(launch, "units_from_flat"), flat,
                 "stage 2 resumed from stage 1's step 3")
    assert_close(assert_copies_equal(launch, "flat_from_units"), units,
                 "stage 1 resumed from stage 2's step 3")
    assert_close(assert_copies_equal(launch, "plain_from_units"), units,
                 "a pipeline without sharding resumed from stage 2's step 3")
