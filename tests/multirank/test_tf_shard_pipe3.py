"""TensorFlow pipeline stages x sharded copies at ``shard.stage=3`` (``pipeline.stages=2``,
``horovodrun -np 4``): each stage's two copies hold half of each of the stage's trainable
variables (and of their Adam slots); each layer's call all-gathers its variables in the stage's
process set for the forward pass, gathers them again in the backward pass and reduce-scatters
their gradient into the copy's slices.

On the digits MLP with a hidden layer of 32 (stage 0: ``fc1``, 2,080 parameters; stage 1: the
head, 330), Adam with L2 weight decay, 1F1B, one epoch over a training split of 337 samples
(``test_fraction=0.8124``): 6 steps of a global batch of 64 (a copy's 32 in 4 micro-batches of
8), the last one short: 9 samples to copy 0 (micro-batches of 8 and 1) and 8 to copy 1 (one of
8), which runs its three empty micro-batches as passes of no rows so that the copies' gathers
pair up (without them, the copies' collectives no longer pair and the run stalls). Asserted:

- after the epoch each copy's parameters equal one process trained on the global batch without
  stages or sharding, within 1e-5 (the copies identical), and so do the logged train losses and
  the final train and eval losses;
- every step hands Horovod, per micro-batch, the stage's whole gradient and the copy's float32
  slices twice (the forward's and the backward's gathers): 32 bytes a stage parameter over the
  two copies, where stage 2 hands 18;
- the stage's checkpoint part holds its parameters and optimizer state whole, by global name, as
  a stage without sharding writes them; a run resumed from step 3 ends bit-identical to the
  uninterrupted run.

`make test` runs Gloo's launch (the run and its resumed run) against one process. `long`: MPI's
launch; resumes across stages 2 and 3 of the same layout, and a pipeline without sharding
resumed from stage 3's step 3, each within 1e-5 of the uninterrupted run;
``shard.reshard_after_forward=false`` (the forward's gathered variables reused) within 1e-5 of
the default, with gpipe. The runs are in test_tf_shard_pipe_units.py's launches (one launch
and one reference for both stages).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.conftest import read_jsonl
from tests.multirank import test_tf_shard_pipe_units as units
from tests.multirank.test_tf_shard_pipe import (
    assert_close,
    assert_copies_equal,
    assert_parts_hold_stages_whole,
)
from tests.multirank.test_tf_shard_pipe_units import AT, STAGE_PARAMETERS

LONG = pytest.mark.long
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """``launches(np, controller, group)``: test_tf_shard_pipe_units.py's launches (see there),
    which hold this module's stage-3 runs."""
    return functools.partial(units.launch, tmp_path_factory)


@pytest.mark.parametrize("controller", ["gloo", pytest.param("mpi", marks=LONG)])
def test_stage_3_sharded_stages_train_as_one_process_and_resume_exactly(launches, controller):
    units.check_units_launch(launches, controller, "shard3", "resumed3",
                             "main" if controller == "gloo" else "main3", "stage-3")


def test_each_step_gathers_the_slices_twice_a_micro_batch(launches):
    logged = [r for r in read_jsonl(launches(4, "gloo").out / "shard3" / "metrics.jsonl")
              if "wire_bytes" in r]
    assert [r["step"] for r in logged] == [2, 4, 6]
    # The mean over the 4 ranks, per micro-batch: the float32 gradient (4 bytes a stage
    # parameter on each copy) and two gathers of the copy's float32 half (2 x 2): 4 x 8 bytes a
    # stage parameter over the stage's two copies; the short step (6) too.
    for record in logged:
        assert record["wire_bytes"] == pytest.approx(32 * sum(STAGE_PARAMETERS) / 2, abs=8)


def test_a_stage_3_part_holds_the_stage_whole_by_global_name(launches):
    checkpoint = launches(4, "gloo").out / "shard3" / "checkpoints" / f"step-{AT:08d}.ckpt"
    for model in assert_parts_hold_stages_whole(checkpoint, AT, STAGE_PARAMETERS):
        assert all(np.any(v != 0) for v in model.values())


@LONG
def test_resumes_across_stages_2_and_3_and_unsharded_agree(launches):
    launch = launches(4, "gloo", "cross3")
    shard3, units = (assert_copies_equal(launch, run) for run in ("shard3", "units"))
    assert_close(units, shard3, "stage 2 against stage 3")
    assert_close(assert_copies_equal(launch, "shard3_from_units"), units,
                 "stage 3 resumed from stage 2's step 3")
    assert_close(assert_copies_equal(launch, "units_from_shard3"), shard3,
                 "stage 2 resumed from stage 3's step 3")
    assert_close(assert_copies_equal(launch, "plain_from_shard3"), shard3,
                 "a pipeline without sharding resumed from stage 3's step 3")
    assert_close(assert_copies_equal(launch, "kept"), shard3,
                 "gpipe, the forward's gathered variables kept, against 1f1b resharded")

