"""PyTorch pipeline stages with every compression method, under horovodrun (Gloo).

``comm.compression`` runs within each stage's Horovod process set: at ``-np 4`` (2 stages x 2
copies) each stage's copies exchange that stage's gradients with the method's plan, as the two
ranks of a data-parallel ``-np 2`` run exchange the whole model's. For top-k with Deep Gradient
Compression's momentum correction (deterministic: no random draws; the exchange applies the
momentum and the optimizer becomes plain SGD) the pipeline's parameters after an epoch therefore
equal the data-parallel run's to float tolerance; so do every other method's, whose random draws
(random-k's indices, qsgd's noise, PowerSGD's first ``Q``) a stage seeds by each tensor's place in
the whole model.

The exchange's state (residuals, velocities) is in the checkpoint's parts, by parameter name: a
pipeline resumed with the same split is bit-identical to the uninterrupted run; a data-parallel
run resumes from the parts, and a pipeline from a data-parallel checkpoint.

Three launches: data parallel at ``-np 2``; the pipelines at ``-np 4``; at ``-np 2`` one pipeline
copy and data parallelism, both resumed from the pipeline's parts.
"""

from __future__ import annotations

import pytest

from tests.conftest import read_jsonl
from tests.multirank.test_pipeline import launch, whole_model
from tests.multirank.test_pipeline_checkpoint import assert_close, step10

ATOL = 1e-5  # float32 sums in another order over 23 steps: the test_pipeline bar
COMMON = ("train.epochs=1,optim.warmup_steps=0,log.every_steps=5,train.stall_timeout_s=120,"
          "checkpoint.every_steps=10,checkpoint.keep=3,comm.min_size=100")
# Each copy (and each data-parallel rank) takes 32 samples a step at lr 0.05 x 2.
PIPE = "data.batch_size=32,optim.lr=0.05,pipeline.stages=2,pipeline.microbatches=4," + COMMON
DATA = "data.batch_size=32,optim.lr=0.05," + COMMON
# No dense start (by default a fraction of the run): the methods from step 1, as these compare.
DGC = ("comm.compression=topk,comm.momentum_correction=true,comm.sparsity_warmup_steps=8,"
       "comm.dense_steps=0")
METHODS = {
    "randomk": "comm.compression=randomk,comm.ratio=0.25,comm.dense_steps=0",
    "qsgd": "comm.compression=qsgd,comm.dense_steps=0",
    "powersgd": "comm.compression=powersgd,comm.dense_steps=0",
    "adam_topk": ("comm.compression=topk,comm.compress_momentum=true,comm.dense_steps=8,"
                  "optim.name=adam,optim.lr=0.005"),
}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Data parallel at -np 2; the pipelines at -np 4 (one resumed from the former); at -np 2 a
    pipeline of one copy and data parallelism resumed from the pipeline's parts (a process whose
    Horovod started without process sets cannot run stages afterwards: hence three launches)."""
    two = tmp_path_factory.mktemp("pipe-comp2")
    launched2 = launch(2, "gloo", two, [
        f"dp:{DATA},{DGC}", *(f"{name}:{DATA},{extra}" for name, extra in METHODS.items())])
    four = tmp_path_factory.mktemp("pipe-comp4")
    launched4 = launch(4, "gloo", four, [
        f"dgc:{PIPE},{DGC}", f"same:{PIPE},{DGC},{step10(four, 'dgc')}",
        f"from_dp:{PIPE},{DGC},{step10(two, 'dp')}",
        *(f"{name}:{PIPE},{extra}" for name, extra in METHODS.items())])
    back = tmp_path_factory.mktemp("pipe-comp2-back")
    resumed2 = launch(2, "gloo", back, [
        f"one_copy:data.batch_size=64,optim.lr=0.1,pipeline.stages=2,pipeline.microbatches=4,"
        f"{COMMON},{DGC},{step10(four, 'dgc')}",
        f"from_parts:{DATA},{DGC},{step10(four, 'dgc')}"])
    return launched2, launched4, resumed2


def test_topk_with_dgc_in_stages_equals_data_parallel(launches):
    launched2, launched4, _ = launches
    want = launched2.rank("dp", 0)[0]
    copy0 = whole_model(launched4, "dgc", [0, 1])
    assert_close(copy0, want, ATOL)
    assert_close(whole_model(launched4, "dgc", [2, 3]), copy0, 0.0)
    # Compression happened in both stages: each stage's wire bytes are well under its dense bytes.
    record = [r for r in read_jsonl(launched4.out / "dgc" / "metrics.jsonl")
              if "wire_bytes" in r][-1]
    assert 0 < record["wire_bytes"] < record["dense_bytes"] / 2


def test_a_resumed_pipeline_keeps_its_residuals_bit_identically(launches):
    _, launched4, _ = launches
    full = whole_model(launched4, "dgc", [0, 1])
    for ranks in ([0, 1], [2, 3]):
        assert_close(whole_model(launched4, "same", ranks), full, 0.0)
    assert launched4.summary("same")["final"] == launched4.summary("dgc")["final"]
    assert read_jsonl(launched4.out / "same" / "metrics.jsonl")[0]["step"] == 15


def test_residuals_and_velocities_move_between_parts_and_a_whole_checkpoint(launches):
    """By parameter name: the data-parallel run's two ranks' rows become the two copies' of each
    stage, and the parts' rows the two ranks'; either run then continues as the uninterrupted one
    (the data-parallel run and the pipeline agree to float tolerance)."""
    launched2, launched4, resumed2 = launches
    want = launched2.rank("dp", 0)[0]
    assert_close(whole_model(launched4, "from_dp", [0, 1]), want, ATOL)
    assert read_jsonl(launched4.out / "from_dp" / "metrics.jsonl")[0]["step"] == 15
    assert_close(resumed2.rank("from_parts", 0)[0], want, ATOL)
    assert read_jsonl(resumed2.out / "from_parts" / "metrics.jsonl")[0]["step"] == 15
    # One copy (the stages' exchanges in process sets of one rank) takes the two copies' rows'
    # mean, as data parallelism does at a new world size, and trains on from step 10.
    one = resumed2.summary("one_copy")
    assert one["pipeline"] == "2 stages x 1 copies" and one["steps"] == 23
    assert read_jsonl(resumed2.out / "one_copy" / "metrics.jsonl")[0]["step"] == 15
    assert one["final"]["train_loss"] < launched4.summary("dgc")["final"]["train_loss"] + 0.05


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_in_stages_equals_it_data_parallel(launches, method):
    """Random-k's indices, qsgd's noise and PowerSGD's first ``Q`` are seeded by each tensor's
    place in the whole model, so a stage draws what the whole model's exchange draws; compressed
    Adam sends dense for 8 steps, then its momentum by top-k."""
    launched2, launched4, _ = launches
    copy0 = whole_model(launched4, method, [0, 1])
    assert_close(copy0, launched2.rank(method, 0)[0], ATOL)
    assert_close(whole_model(launched4, method, [2, 3]), copy0, 0.0)
    assert launched4.summary(method)["steps"] == 23
