"""TensorFlow pipeline stages with compression: their exchange state in the checkpoint's parts,
under horovodrun (Gloo).

Top-k with error feedback at ``-np 2`` (2 stages, one copy) exchanges what one process's
exchange of the whole model does (each stage's tensors, in a process set of its one rank), so
the two runs' parameters after an epoch agree to float tolerance; random-k agrees too, since a
stage seeds its draws by each tensor's place in the whole model. The residuals are in each
stage's part by variable name: the pipeline resumed from its step 10 with the same split ends
bit-identical to the uninterrupted run, a run without stages resumes from those parts, and the
pipeline from the whole model's checkpoint; each ends as the uninterrupted run does.

Three launches (TensorFlow's start-up is most of each): ``-np 1``, ``-np 2``, ``-np 1``. The
``-np 4`` (2 stages x 2 copies) against data-parallel ``-np 2`` comparison is `long`.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import read_jsonl
from tests.multirank.test_pipeline_checkpoint import (
    assert_same_list,
    step10,
    tf_launch,
    tf_whole,
)
from tests.multirank.test_pipeline_tf import stage_params

ATOL = 1e-5  # float32 sums in another order (micro-batches) over 45 steps
COMMON = ("optim.name=sgd,optim.lr=0.1,optim.scale_lr=false,optim.warmup_steps=0,"
          "train.epochs=1,log.every_steps=5,checkpoint.every_steps=10,checkpoint.keep=5,"
          "comm.ratio=0.1,comm.min_size=100")
TOPK = "comm.compression=topk," + COMMON
RANDOMK = "comm.compression=randomk,checkpoint.enabled=false," + COMMON
STAGES = "pipeline.stages=2,pipeline.microbatches=4,pipeline.schedule=1f1b"
# fc1's kernel (layer 1, stage 0) and the head's (layer 3, stage 1): each stage's residuals.
RESIDUALS = {"stage-0": ["compression/residual/1.0"],
             "stage-1": ["compression/residual/2.0", "compression/residual/3.0"]}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Without stages at -np 1; the pipelines at -np 2 (one resumed from the former's
    checkpoint); without stages again, resumed from the pipeline's parts."""
    one = tmp_path_factory.mktemp("tf-comp1")
    launched1 = tf_launch(1, one, [f"whole:data.batch_size=32,{TOPK}",
                                   f"randomk:data.batch_size=32,{RANDOMK}"])
    two = tmp_path_factory.mktemp("tf-comp2")
    pipe = f"data.batch_size=32,{STAGES},{TOPK}"
    launched2 = tf_launch(2, two, [
        f"full:{pipe}", f"same:{pipe},{step10(two, 'full')}",
        f"from_whole:{pipe},{step10(one, 'whole')}",
        f"randomk:data.batch_size=32,{STAGES},{RANDOMK}"])
    back = tmp_path_factory.mktemp("tf-comp1-back")
    resumed1 = tf_launch(1, back, [f"from_parts:data.batch_size=32,{TOPK},{step10(two, 'full')}"])
    return launched1, launched2, resumed1


def first_step(launched, run: str) -> int:
    return read_jsonl(launched.out / run / "metrics.jsonl")[0]["step"]


@pytest.mark.timeout(1200)  # three launches; slow on busy shared cores
def test_tf_stages_with_topk_resume_with_their_residuals(launches):
    launched1, launched2, resumed1 = launches
    whole = tf_whole(launched1, "whole")
    full = stage_params(launched2, "full", [0, 1])
    assert_same_list(full, whole, ATOL)
    record = [r for r in read_jsonl(launched2.out / "full" / "metrics.jsonl")
              if "wire_bytes" in r][-1]
    assert 0 < record["wire_bytes"] < record["dense_bytes"] / 2

    # Each stage's part holds its residuals (one row: one copy), by global variable name.
    ckpts = launched2.out / "full" / "checkpoints"
    for stage, keys in RESIDUALS.items():
        with np.load(ckpts / f"step-00000010.{stage}.part") as part:
            assert str(part["compression/method"]) == "topk"
            assert int(part["compression/step"]) == 10
            for key in keys:
                assert part[key].shape[0] == 1 and np.abs(part[key]).max() > 0, key

    # Same split: bit-identical to the uninterrupted run.
    assert_same_list(stage_params(launched2, "same", [0, 1]), full, 0.0)
    assert launched2.summary("same")["final"] == launched2.summary("full")["final"]
    assert first_step(launched2, "same") == 15  # it resumed at 10

    # Between parts and a whole checkpoint, both ways: each continues as the uninterrupted run.
    assert_same_list(stage_params(launched2, "from_whole", [0, 1]), whole, ATOL)
    assert first_step(launched2, "from_whole") == 15
    assert_same_list(tf_whole(resumed1, "from_parts"), full, ATOL)
    assert first_step(resumed1, "from_parts") == 15


def test_tf_stages_draw_randomk_as_the_whole_model(launches):
    launched1, launched2, _ = launches
    assert_same_list(stage_params(launched2, "randomk", [0, 1]), tf_whole(launched1, "randomk"),
                     ATOL)
