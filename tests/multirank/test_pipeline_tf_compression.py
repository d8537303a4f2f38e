"""TensorFlow pipeline stages with compression: their exchange state in the checkpoint's parts,
under horovodrun (Gloo).

Top-k with error feedback at ``-np 4`` (2 stages x 2 copies): each stage's copies exchange that
stage's gradients as the two ranks of a data-parallel ``-np 2`` run exchange the whole model's, so
the two runs' parameters after an epoch (45 steps) agree to float tolerance; random-k agrees too,
since a stage seeds its draws by each tensor's place in the whole model. Each stage's part holds
its copies' residuals (a row per copy) by variable name: the pipeline resumed from its step 10 with
the same split ends bit-identical to the uninterrupted run, a run without stages resumes from the
parts, and the pipeline from the data-parallel run's checkpoint; each ends as the uninterrupted
run does.

Three launches (TensorFlow's start-up is most of each): ``-np 2``, ``-np 4``, ``-np 2``, about a
minute. `long`: the same at ``-np 2`` (2 stages, one copy: a stage's exchange in a process set of
its one rank) against one process (``-np 1``).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import read_jsonl
from tests.multirank.conftest import Launch
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
          "comm.ratio=0.1,comm.min_size=100,comm.dense_steps=0")  # compressed from step 1
TOPK = "comm.compression=topk," + COMMON
RANDOMK = ("comm.compression=randomk," + COMMON
           + ",checkpoint.enabled=false,checkpoint.every_steps=0,checkpoint.keep=3")
STAGES = "pipeline.stages=2,pipeline.microbatches=4,pipeline.schedule=1f1b"
# fc1's kernel (layer 1, stage 0) and the head's (layer 3, stage 1): each stage's residuals.
RESIDUALS = {"stage-0": ["compression/residual/1.0"],
             "stage-1": ["compression/residual/2.0", "compression/residual/3.0"]}


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """Data parallel at -np 2; the pipelines at -np 4 (one resumed from the former); data
    parallel at -np 2 resumed from the pipeline's parts (a process whose Horovod started without
    process sets cannot run stages afterwards: hence three launches)."""
    two = tmp_path_factory.mktemp("tf-comp-dp")
    launched2 = tf_launch(2, two, [f"dp:data.batch_size=32,{TOPK}",
                                   f"randomk:data.batch_size=32,{RANDOMK}"])
    four = tmp_path_factory.mktemp("tf-comp4")
    pipe = f"data.batch_size=32,{STAGES},{TOPK}"
    launched4 = tf_launch(4, four, [f"full:{pipe}", f"same:{pipe},{step10(four, 'full')}",
                                    f"from_dp:{pipe},{step10(two, 'dp')}",
                                    f"randomk:data.batch_size=32,{STAGES},{RANDOMK}"])
    back = tmp_path_factory.mktemp("tf-comp-dp-back")
    resumed2 = tf_launch(2, back, [f"from_parts:data.batch_size=32,{TOPK},{step10(four, 'full')}"])
    return launched2, launched4, resumed2


@pytest.fixture(scope="module")
def one_copy(tmp_path_factory):
    """One process; the pipelines at -np 2 (one resumed from the former); one process resumed
    from the pipeline's parts."""
    one = tmp_path_factory.mktemp("tf-comp1")
    launched1 = tf_launch(1, one, [f"whole:data.batch_size=32,{TOPK}"])
    two = tmp_path_factory.mktemp("tf-comp2")
    pipe = f"data.batch_size=32,{STAGES},{TOPK}"
    launched2 = tf_launch(2, two, [f"full:{pipe}", f"same:{pipe},{step10(two, 'full')}",
                                   f"from_whole:{pipe},{step10(one, 'whole')}"])
    back = tmp_path_factory.mktemp("tf-comp1-back")
    resumed1 = tf_launch(1, back, [f"from_parts:data.batch_size=32,{TOPK},{step10(two, 'full')}"])
    return launched1, launched2, resumed1


def first_step(launched: Launch, run: str) -> int:
    return read_jsonl(launched.out / run / "metrics.jsonl")[0]["step"]


def check_resumes(whole: Launch, pipe: Launch, back: Launch, source: str, copies: int) -> None:
    """The checks of both sequences: ``whole`` ran ``source`` without stages, ``pipe`` the
    pipelines of ``copies`` copies, ``back`` the run without stages from the pipeline's parts."""
    want = tf_whole(whole, source)
    full = stage_params(pipe, "full", [0, 1])
    assert_same_list(full, want, ATOL)
    record = [r for r in read_jsonl(pipe.out / "full" / "metrics.jsonl") if "wire_bytes" in r][-1]
    assert 0 < record["wire_bytes"] < record["dense_bytes"] / 2

    # Each stage's part holds every copy's residuals (a row each), by global variable name.
    ckpts = pipe.out / "full" / "checkpoints"
    for stage, keys in RESIDUALS.items():
        with np.load(ckpts / f"step-00000010.{stage}.part") as part:
            assert str(part["compression/method"]) == "topk"
            assert int(part["compression/step"]) == 10
            for key in keys:
                rows = part[key]
                assert rows.shape[0] == copies and np.abs(rows).max() > 0, key
                assert copies == 1 or not np.array_equal(rows[0], rows[1]), key

    # Same split: bit-identical to the uninterrupted run, every copy.
    for ranks in [[2 * c, 2 * c + 1] for c in range(copies)]:
        assert_same_list(stage_params(pipe, "same", ranks), full, 0.0)
        assert_same_list(stage_params(pipe, f"from_{source}", ranks), want, ATOL)
    assert pipe.summary("same")["final"] == pipe.summary("full")["final"]
    assert first_step(pipe, "same") == first_step(pipe, f"from_{source}") == 15  # from step 10
    # Parts -> a run without stages: it continues as the uninterrupted run.
    assert_same_list(tf_whole(back, "from_parts"), full, ATOL)
    assert first_step(back, "from_parts") == 15


@pytest.mark.timeout(1200)  # three launches; slow on busy shared cores
def test_tf_stage_copies_resume_with_their_residuals(copies):
    check_resumes(*copies, source="dp", copies=2)


def test_tf_stages_draw_randomk_as_the_whole_model(copies):
    launched2, launched4, _ = copies
    copy0 = stage_params(launched4, "randomk", [0, 1])
    assert_same_list(copy0, tf_whole(launched2, "randomk"), ATOL)
    assert_same_list(stage_params(launched4, "randomk", [2, 3]), copy0, 0.0)


@pytest.mark.long
@pytest.mark.timeout(1200)
def test_tf_stages_of_one_copy_resume_with_their_residuals(one_copy):
    check_resumes(*one_copy, source="whole", copies=1)
