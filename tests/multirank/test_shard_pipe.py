"""PyTorch pipeline stages x sharded copies (``pipeline.stages=2``, ``shard.stage=1``) at
``horovodrun -np 4``: each stage's two copies shard that stage's optimizer state in the stage's
Horovod process set (reduce-scatter, the shard's Adam step, all-gather, in place of the stage's
allreduce).

On the digits MLP with hidden layers of 32 and 16 (stage 0: ``fc1``, 2,080 parameters; stage 1:
``fc2`` and the head, 698), Adam with L2 weight decay, one epoch of 23 steps (the last one short):

- after the epoch each copy's parameters equal one process trained on the global batch of 64
  without stages or sharding, within 1e-5 (the copies identical), and the train and eval losses
  agree: what the zero-gradient step, the stage's reduce-scatter in its set and the shard's update
  have to get right;
- every step hands Horovod the stage's whole gradient plus its float32 shard (1.5 x the stage's
  gradient bytes, the ring's 1 x), so the sharded update is what ran;
- each stage's checkpoint part holds its optimizer state whole (Adam's moments of each of its
  parameters, in the ring's layout); a run resumed from step 10 with sharding ends bit-identical
  to the uninterrupted run.

At ``shard.stage`` 2 and 3 the units (the stage's layers) are sharded too: every micro-batch's
backward pass reduce-scatters each unit's gradient into the copy's shard, and stage 3 gathers a
unit before each micro-batch's forward and backward pass. The same equality with one process
holds, each step hands Horovod every micro-batch's whole gradient plus the shard's all-gathers
(stage 2: once, 18 bytes a stage parameter at 4 micro-batches; stage 3: before each forward and
backward pass, 32), and a run resumed from step 10 ends bit-identical.

`make test` runs Gloo's launch (the two runs back to back) against the one-process reference
trained in the test's own process, and stage 3's launch (full run and resumed run); stage 2's
launch is `long`. `long` (`make test-long`): MPI's launch, where the equality
holds too (1F1B and interleaved 1F1B), a pipeline without sharding resumes from the sharded run's
step 10, and the sharded pipeline from the step 10 of one without sharding and from that of a
sharded run without stages (its per-rank shard files), each within 1e-5 of the uninterrupted run;
and stage 3 evaluating copies that hold uneven numbers of eval batches (361 test samples in
batches of 20: 10 and 9), whose gathers pair up only because the copy with fewer runs an empty
batch, against one process's evaluation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hvdtrain.data.sampler import eval_shards
from hvdtrain.driver import train
from tests.conftest import CONFIG, quiet_config, read_jsonl
from tests.multirank.conftest import Launch
from tests.multirank.test_pipeline import assert_same_model, launch, whole_model

COMMON = ("optim.name=adam,optim.lr=0.01,optim.weight_decay=0.01,optim.scale_lr=false,"
          "optim.warmup_steps=0,train.epochs=1,log.every_steps=5,train.stall_timeout_s=120")
PIPE = ("data.batch_size=32,pipeline.stages=2,pipeline.microbatches=4,checkpoint.every_steps=10,"
        "checkpoint.keep=3," + COMMON)
"""2 copies of 32 samples a step: the global batch of 64, at the same rate (no scaling)."""
SHARDED = PIPE + ",shard.stage=1,shard.chunk_kib=4"  # stage 0's 1,040-element shards: 2 rounds
WHOLE = ["data.batch_size=64", "model.options.hidden=[32,16]", *COMMON.split(",")]
FLAT = "data.batch_size=16,shard.stage=1,checkpoint.every_steps=10,checkpoint.keep=3," + COMMON
"""Sharded data parallel without stages at -np 4: the same global batch of 64."""
ATOL = 1e-5  # float32 sums in another order over 23 steps (seen: 6e-8); a wrong weight: 1e-3
pytestmark = pytest.mark.timeout(1500)


def resume(out: Path, run: str, number: int) -> str:
    """The override that resumes from checkpoint ``number`` of run ``run`` under ``out``."""
    return f"checkpoint.resume={out / run / 'checkpoints' / f'step-{number:08d}.ckpt'}"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[dict[str, np.ndarray], dict]:
    """One process without stages or sharding on the global batch (in this process, Horovod at
    size 1): its parameters, named as the pipeline's layers, and its final metrics."""
    out = tmp_path_factory.mktemp("shard-pipe-ref")
    result = train(quiet_config(CONFIG, out, *WHOLE, "checkpoint.enabled=false",
                                "checkpoint.every_steps=0"))
    assert result.engine is not None
    return result.engine.parameters(), result.summary["final"]


def assert_equals_one_process(launched: Launch, run: str, want: dict[str, np.ndarray],
                              final: dict, stage: int = 1) -> None:
    """Each copy of ``run`` holds ``want``'s parameters (within ATOL), the copies the same."""
    copy0 = whole_model(launched, run, [0, 1])
    assert_same_model(copy0, want, ATOL)
    assert_same_model(whole_model(launched, run, [2, 3]), copy0, 0.0)
    summary = launched.summary(run)
    assert (summary["pipeline"], summary["shard_stage"], summary["shard_ranks"],
            summary["steps"]) == ("2 stages x 2 copies", stage, 2, 23)
    for key in ("train_loss", "eval_loss"):
        assert summary["final"][key] == pytest.approx(final[key], rel=1e-4), key


def sharded_step_bytes(launched: Launch, run: str, per_element: float = 6.0) -> float:
    """What a step hands Horovod, as a record gives it (the mean over the ranks), in bytes per
    element of each rank's stage: at stage 1 its whole float32 gradient and its float32 half
    of it (6)."""
    counts = [sum(p.size for p in launched.rank(run, r)[0].values()) for r in range(4)]
    return sum(per_element * n for n in counts) / 4


@pytest.mark.timeout(900)
def test_two_stages_by_two_sharded_copies_equal_one_process_and_resume(tmp_path, one_process):
    want, final = one_process
    out = tmp_path / "np4"
    launched = launch(4, "gloo", out, [
        f"full:{SHARDED}",
        f"same:{SHARDED},{resume(out, 'full', 10)}"])
    assert_equals_one_process(launched, "full", want, final)
    records = [r for r in read_jsonl(out / "full" / "metrics.jsonl") if "wire_bytes" in r]
    assert records and {r["wire_bytes"] for r in records} == {sharded_step_bytes(launched, "full")}
    # Each stage's part: its optimizer state gathered whole, as the ring's, by its parameters.
    for stage, (first, last) in enumerate(((0, 1), (1, 3))):
        part = torch.load(out / "full" / "checkpoints" / f"step-00000010.stage-{stage}.part",
                          weights_only=True)
        params = {name: p for name, p in launched.rank("full", stage)[0].items()}
        assert part["params"] == list(params) and len(params) == 2 * (last - first)
        state = part["optimizer"]["state"]
        assert sorted(state) == list(range(len(params)))
        for index, name in enumerate(part["params"]):
            for key in ("exp_avg", "exp_avg_sq"):
                assert tuple(state[index][key].shape) == params[name].shape, (stage, name, key)
            assert float(state[index]["step"]) == 10 + 1  # the zero-gradient step, as the ring's
    # Resumed with sharding from its step 10: bit-identical to the uninterrupted run.
    full = whole_model(launched, "full", [0, 1])
    for ranks in ([0, 1], [2, 3]):
        assert_same_model(whole_model(launched, "same", ranks), full, 0.0)
    assert launched.summary("same")["final"] == launched.summary("full")["final"]
    assert read_jsonl(out / "same" / "metrics.jsonl")[0]["step"] == 15  # it resumed at 10


@pytest.mark.long
@pytest.mark.timeout(900)
def test_under_mpi_and_resumed_with_or_without_sharding(tmp_path, one_process):
    """MPI's launch: the sharded pipeline equals one process, with 1F1B and with interleaved 1F1B
    (two pieces a rank, one shard over both); a pipeline without sharding resumes from its step
    10, and it from the step 10 of a pipeline without sharding, and from the step 10 of a sharded
    run without stages (4 copies of 16: every rank's shard file, assembled whole by rank 0), each
    within ATOL."""
    want, final = one_process
    out = tmp_path / "np4-mpi"
    launched = launch(4, "mpi", out, [
        f"full:{SHARDED}",
        f"interleaved:{SHARDED},pipeline.schedule=interleaved_1f1b,pipeline.virtual_stages=2",
        f"plain:{PIPE},{resume(out, 'full', 10)}",
        f"unsharded:{PIPE}",
        f"back:{SHARDED},{resume(out, 'unsharded', 10)}",
        f"flat:{FLAT}",
        f"from_flat:{SHARDED},{resume(out, 'flat', 10)}"])
    assert_equals_one_process(launched, "full", want, final)
    assert_equals_one_process(launched, "interleaved", want, final)
    full = whole_model(launched, "full", [0, 1])
    assert (out / "flat" / "checkpoints" / "step-00000010.rank-3.part").exists()
    for run in ("plain", "back", "from_flat"):
        assert_same_model(whole_model(launched, run, [0, 1]), full, ATOL)
        assert read_jsonl(out / run / "metrics.jsonl")[0]["step"] == 15, run
    assert "shard_stage" not in launched.summary("plain")
    assert launched.summary("back")["shard_stage"] == 1


UNIT_BYTES = {2: 4 * 4 + 4 / 2, 3: 4 * 4 + 2 * 4 * 4 / 2}
"""Bytes a step hands Horovod per element of a rank's stage at 4 micro-batches: every
micro-batch's float32 gradient to reduce-scatter, plus its float32 half to all-gather once
(stage 2) or before each micro-batch's forward and backward pass (stage 3)."""


def check_units_sharded(tmp_path: Path, one_process: tuple, stage: int) -> None:
    """``shard.stage`` ``stage`` (2 or 3) at 2 stages x 2 copies: one process's parameters and
    losses, the byte count of its collectives, each part's whole parameters and Adam state, and
    a run resumed from step 10 bit-identical."""
    want, final = one_process
    out = tmp_path / f"np4-stage{stage}"
    run = f"{PIPE},shard.stage={stage}"
    launched = launch(4, "gloo", out, [f"full:{run}", f"same:{run},{resume(out, 'full', 10)}"])
    assert_equals_one_process(launched, "full", want, final, stage)
    records = [r for r in read_jsonl(out / "full" / "metrics.jsonl") if "wire_bytes" in r]
    assert records and {r["wire_bytes"] for r in records} == {
        sharded_step_bytes(launched, "full", UNIT_BYTES[stage])}
    part = torch.load(out / "full" / "checkpoints" / "step-00000010.stage-0.part",
                      weights_only=True)
    assert sorted(part["model"]) == ["1.bias", "1.weight"]
    assert tuple(part["model"]["1.weight"].shape) == (32, 64)  # gathered whole at stage 3 too
    state = part["optimizer"]["state"]
    assert tuple(state[0]["exp_avg"].shape) == (32, 64) and float(state[0]["step"]) == 11
    full = whole_model(launched, "full", [0, 1])
    for ranks in ([0, 1], [2, 3]):
        assert_same_model(whole_model(launched, "same", ranks), full, 0.0)
    assert launched.summary("same")["final"] == launched.summary("full")["final"]
    assert read_jsonl(out / "same" / "metrics.jsonl")[0]["step"] == 15  # it resumed at 10


@pytest.mark.timeout(900)
def test_stage_3_sharded_copies_of_two_stages_equal_one_process_and_resume(tmp_path,
                                                                           one_process):
    check_units_sharded(tmp_path, one_process, 3)


@pytest.mark.long
@pytest.mark.timeout(900)
def test_stage_2_sharded_copies_of_two_stages_equal_one_process_and_resume(tmp_path,
                                                                           one_process):
    check_units_sharded(tmp_path, one_process, 2)


EVAL_FRACTION = 0.2005
"""A test split of 361 samples: 181 for copy 0, 180 for copy 1."""
UNEVEN_EVAL = (f"data.options.test_fraction={EVAL_FRACTION},data.eval_batch_size=20,"
               "train.max_steps=3,checkpoint.enabled=false,checkpoint.every_steps=0")


@pytest.mark.long
@pytest.mark.timeout(900)
def test_stage_3_evaluates_copies_with_uneven_eval_batches(tmp_path):
    """At shard.stage=3 each eval batch's forward gathers the stage's units among its copies.
    361 test samples in batches of 20: copy 0 holds 181 (10 batches, the last of 1), copy 1 180
    (9 full ones). :func:`hvdtrain.data.sampler.eval_shards` gives copy 1 an empty tenth batch,
    which the stage runs (padded, no real row) so that its gathers pair with copy 0's; without it
    copy 0's tenth forward waits for ever (the run dies at the stall timeout). The evaluation then
    counts every sample once and equals one process's after the same 3 steps."""
    assert [[len(b) for b in eval_shards(361, c, 2, 20)][-1] for c in range(2)] == [1, 0]
    out = tmp_path / "np4-uneven-eval"
    launched = launch(4, "gloo", out, [f"uneven:{PIPE},shard.stage=3,{UNEVEN_EVAL}"])
    ref = train(quiet_config(CONFIG, tmp_path / "ref", *WHOLE, *UNEVEN_EVAL.split(",")))
    # The last stage of each copy (ranks 1 and 3) scored its own share of the test split.
    counts = [launched.rank("uneven", r)[1]["local_eval"]["count"] for r in (1, 3)]
    assert counts == [181, 180]
    summary = launched.summary("uneven")
    assert (summary["shard_stage"], summary["steps"]) == (3, 3)
    for key in ("eval_loss", "eval_accuracy", "train_loss"):
        assert summary["final"][key] == pytest.approx(ref.summary["final"][key], rel=1e-4), key
