"""TensorFlow pipeline stages x sharded copies (``pipeline.stages=2``, ``shard.stage=1``) at
``horovodrun -np 4``: each stage's two copies shard that stage's optimizer state in the stage's
Horovod process set (reduce-scatter, the shard's Adam step, all-gather, in place of the stage's
average).

On the digits MLP with a hidden layer of 32 (stage 0: ``fc1``, 2,080 parameters, sharded in
rounds of 4 KiB: two a step; stage 1: the head, 330), Adam with L2 weight decay, 12 steps of a
global batch of 16 (a copy's 8 in 4 micro-batches of 2, 1F1B):

- each copy's parameters equal one process's trained on the global batch without stages or
  sharding, within 1e-5 (the copies identical), and so does the train loss;
- every step hands Horovod the stage's whole gradient plus its float32 shard (1.5 x the stage's
  gradient bytes), so the sharded update is what ran;
- each stage's checkpoint part holds its optimizer state whole, each slot by its variable's global
  name and shape, as a stage without sharding writes it; a run resumed from step 6 with sharding
  ends bit-identical to the uninterrupted run.

`make test` runs Gloo's launch (the sharded run and its resumed run) against one process.
`long` (`make test-long`): a pipeline without sharding resumed from the sharded step 6 and a
sharded pipeline resumed from the step 6 of one without sharding, both within 1e-5 of the
uninterrupted runs (seen: equal to the bit, as is the plain pipeline to the sharded one); MPI's
launch, where the equality holds too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hvdtrain.checkpoint import parts_of
from hvdtrain.shard import step_bytes
from tests.conftest import read_jsonl
from tests.multirank.conftest import Launch, launch_worker
from tests.multirank.test_pipeline_tf import stage_params

COMMON = ("model.options.hidden=[32],optim.name=adam,optim.lr=0.01,optim.weight_decay=0.01,"
          "optim.scale_lr=false,optim.warmup_steps=0,train.epochs=1,train.max_steps=12,"
          "log.every_steps=4,train.stall_timeout_s=120")
PIPE = ("data.batch_size=8,pipeline.stages=2,pipeline.microbatches=4,pipeline.schedule=1f1b,"
        "checkpoint.every_steps=6,checkpoint.keep=3," + COMMON)
"""2 copies of 8 samples a step: the global batch of 16, at the same rate (no scaling)."""
SHARDED = PIPE + ",shard.stage=1,shard.chunk_kib=4"  # stage 0's 1,040-element shards: 2 rounds
ONE = "data.batch_size=16,checkpoint.enabled=false,checkpoint.every_steps=0," + COMMON
ATOL = 1e-5  # float32 sums in another order over 12 steps; a wrong weight moves 1e-3
AT = 6
"""The step whose checkpoint the resumed runs start from."""
STAGE_PARAMETERS = (64 * 32 + 32, 32 * 10 + 10)
LONG = pytest.mark.long
pytestmark = pytest.mark.timeout(1500)


def resume(out: Path, run: str, number: int) -> str:
    """The override that resumes from checkpoint ``number`` of run ``run`` under ``out``."""
    return f"checkpoint.resume={out / run / 'checkpoints' / f'step-{number:08d}.ckpt'}"


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """``launches(np, controller, group)``: one launch on first use; ``np`` 1 is the one-process
    reference, ``group`` "main" the sharded run and its resumed run, "cross" the resumes across
    sharding (a plain pipeline, resumed sharded; the sharded run's step 6, resumed plain)."""
    cache: dict[tuple[int, str, str], Launch] = {}

    def get(np_: int, controller: str, group: str = "main") -> Launch:
        if (np_, controller, group) not in cache:
            out = tmp_path_factory.mktemp(f"tf-shard-pipe-np{np_}-{controller}-{group}")
            if np_ == 1:
                runs = [f"one:{ONE}"]
            else:
                runs = [f"sharded:{SHARDED}", f"resumed:{SHARDED},{resume(out, 'sharded', AT)}"]
                if group == "cross":
                    runs += [f"plain:{PIPE}",
                             f"plain_from_sharded:{PIPE},{resume(out, 'sharded', AT)}",
                             f"sharded_from_plain:{SHARDED},{resume(out, 'plain', AT)}"]
            cache[np_, controller, group] = launch_worker(np_, controller, "tensorflow", out, runs)
        return cache[np_, controller, group]

    return get


def reference(launches) -> tuple[list[np.ndarray], dict]:
    one = launches(1, "gloo")
    params, record = one.rank("one", 0)
    return [params[k] for k in sorted(params, key=lambda n: int(n.split(".")[0]))], record


def assert_close(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    assert [p.shape for p in got] == [p.shape for p in want], what
    for mine, theirs in zip(got, want, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=ATOL, err_msg=what)


def assert_copies_equal(launch: Launch, run: str) -> list[np.ndarray]:
    """Copy 0's parameters (ranks 0 and 1), which copy 1's (ranks 2 and 3) equal bit for bit."""
    copy0 = stage_params(launch, run, [0, 1])
    for mine, theirs in zip(stage_params(launch, run, [2, 3]), copy0, strict=True):
        assert np.array_equal(mine, theirs), run
    return copy0


def step_losses(out: Path, run: str) -> list[tuple[int, float]]:
    """The logged train losses (every ``log.every_steps``) with their steps."""
    return [(r["step"], r["loss"]) for r in read_jsonl(out / run / "metrics.jsonl")
            if "loss" in r]


def check_sharded_launch(launches, controller: str) -> None:
    want, one = reference(launches)
    launch = launches(4, controller)
    got = assert_copies_equal(launch, "sharded")
    assert_close(got, want, f"sharded stages against one process ({controller})")
    losses, ones = (step_losses(out, run) for out, run in ((launch.out, "sharded"),
                                                           (launches(1, "gloo").out, "one")))
    assert [s for s, _ in losses] == [s for s, _ in ones] == [4, 8, 12]
    np.testing.assert_allclose([v for _, v in losses], [v for _, v in ones], rtol=1e-5)
    assert launch.summary("sharded")["steps"] == one["summary"]["steps"] == 12
    # The resumed run: the very bits of the uninterrupted one, on every rank.
    for rank in range(4):
        resumed, _ = launch.rank("resumed", rank)
        for key, value in launch.rank("sharded", rank)[0].items():
            assert np.array_equal(resumed[key], value), (rank, key)


@pytest.mark.parametrize("controller", ["gloo", pytest.param("mpi", marks=LONG)])
def test_sharded_stages_train_as_one_process_and_resume_exactly(launches, controller):
    check_sharded_launch(launches, controller)


def test_each_step_sends_the_stage_gradient_and_its_shard(launches):
    launch = launches(4, "gloo")
    # Per rank and step: its stage's gradient to reduce-scatter, its shard to all-gather.
    per_rank = [step_bytes(n, n // 2, "none") for n in STAGE_PARAMETERS] * 2
    logged = [r for r in read_jsonl(launch.out / "sharded" / "metrics.jsonl") if "wire_bytes" in r]
    assert logged
    for record in logged:
        assert record["wire_bytes"] == sum(w for w, _ in per_rank) / 4
        assert record["wire_bytes"] == 1.5 * 4 * sum(STAGE_PARAMETERS) / 2


def assert_parts_hold_stages_whole(checkpoint: Path, at: int, stage_parameters: list[int]
                                   ) -> list[dict[str, np.ndarray]]:
    """A stage's checkpoint part holds its parameters and Adam's two moments whole, by global
    name, each moment in its variable's shape and none of them zero; returns each part's model."""
    parts = parts_of(checkpoint)
    assert [p.name for p in parts] == [f"step-{at:08d}.stage-{k}.part" for k in (0, 1)]
    models = []
    for part, parameters in zip(parts, stage_parameters, strict=True):
        with np.load(part) as npz:
            arrays = {k: npz[k] for k in npz.files}
        model = {k[len("model/"):]: v for k, v in arrays.items() if k.startswith("model/")}
        slots = {k[len("optimizer/"):]: v for k, v in arrays.items()
                 if k.startswith("optimizer/") and not k.startswith("optimizer/opt/")}
        assert sorted(slots) == sorted(f"{n}/{kind}" for n in model
                                       for kind in ("momentum", "velocity"))
        for name, slot in slots.items():
            assert slot.shape == model[name.split("/")[0]].shape and np.any(slot != 0), name
        assert sum(v.size for v in model.values()) == parameters
        assert int(arrays["optimizer/opt/iteration"]) == at
        models.append(model)
    return models


def test_a_stage_part_holds_its_optimizer_state_whole_by_global_name(launches):
    assert_parts_hold_stages_whole(
        launches(4, "gloo").out / "sharded" / "checkpoints" / f"step-{AT:08d}.ckpt", AT,
        STAGE_PARAMETERS)


@LONG
def test_resumes_across_sharding_agree_with_the_uninterrupted_runs(launches):
    launch = launches(4, "gloo", "cross")
    sharded, plain = (assert_copies_equal(launch, run) for run in ("sharded", "plain"))
    assert_close(plain, sharded, "a pipeline without sharding against the sharded one")
    assert_close(assert_copies_equal(launch, "plain_from_sharded"), sharded,
                 "a plain pipeline resumed from the sharded step 6")
    assert_close(assert_copies_equal(launch, "sharded_from_plain"), plain,
                 "a sharded pipeline resumed from the plain step 6")
