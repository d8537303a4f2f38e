"""Pipeline stages composed with Horovod data parallelism, under horovodrun (Gloo and MPI).

At ``-np 4`` with 2 stages x 2 copies, and at ``-np 2`` with 2 stages and one copy, the parameters
after one epoch equal one process trained on the global batch (to float tolerance), for every
schedule the config accepts (GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble): the
schedules, the padding of the epoch's short last step (1,437 samples: its 29 leave one copy 15 and
the other 14 of 32 rows, two of four micro-batches empty), the loss weighting and the stage's
Horovod average in its process set all have to be right. A launch trains several schedules back
to back.

`make test` runs Gloo's launch of every schedule and MPI's launch of 1F1B alone (the cheapest row
that averages a stage in an MPI process set); MPI's other schedules and the 2-rank pipelines are
`long` (`make test-long`): 2 stages of one copy equal the ring in make test in test_hf_shard.py
(Hugging Face's GPT-2), and train in test_pipeline_checkpoint.py's stop and resume.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import BIN, CONFIG, horovodrun, read_jsonl, run_env
from tests.multirank.conftest import CONFIGS, PYTHON, WORKER, Launch
from tests.multirank.test_stop_resume import pid_of_rank, wait_for_records

COMMON = ("train.epochs=1,optim.warmup_steps=0,log.every_steps=5,"
          "train.stall_timeout_s=120")
SCHEDULES = {"gpipe": "pipeline.schedule=gpipe", "1f1b": "pipeline.schedule=1f1b",
             "interleaved": "pipeline.schedule=interleaved_1f1b,pipeline.virtual_stages=2",
             "interleaved_zb": "pipeline.schedule=interleaved_zero_bubble,pipeline.virtual_stages=2"}
# zbv_zero_bubble and dualpipev are refused by the config (hvdtrain/pipeline/schedules.py).
# 2 copies x 32 samples at lr 0.05 (scaled by the 2 copies) against one process with 64 at 0.1.
PER_COPY = "data.batch_size=32,optim.lr=0.05,pipeline.stages=2,pipeline.microbatches=4," + COMMON
WHOLE = "data.batch_size=64,optim.lr=0.1," + COMMON
# The -np 4 launches, by controller: the first of each in `make test`, the second `long`.
LAUNCHES = {"gloo": (["gpipe", "1f1b", "interleaved", "interleaved_zb"], []),
            "mpi": (["1f1b"], ["gpipe", "interleaved", "interleaved_zb"])}
ROWS = [(controller, name) if n == 0 else pytest.param(controller, name, marks=pytest.mark.long)
        for controller, groups in LAUNCHES.items() for n, group in enumerate(groups)
        for name in group]
"""(controller, schedule) of the -np 4 equality."""
ATOL = 1e-5  # float32 sums in another order over 23 steps; a wrong weight moves them by 1e-3


def launch(np_: int, controller: str, out: Path, runs: list[str],
           hidden: tuple[int, ...] = (32, 16)) -> Launch:
    """The multirank worker under horovodrun on the digits MLP with two hidden layers (six layers:
    interleaved 1F1B's four pieces then leave every rank some parameters), or ``hidden``."""
    out.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load(CONFIG.read_text())
    config["model"]["options"]["hidden"] = list(hidden)
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    proc = horovodrun(np_, controller, [PYTHON, WORKER, str(out), str(out / "config.yaml"), *runs],
                      timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return Launch("torch", controller, out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Launch:
    """One process, no stages, on the global batch of 64."""
    return launch(1, "gloo", tmp_path_factory.mktemp("pipe-ref"), ["ref:" + WHOLE])


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """``four_ranks(controller, schedule)``: the -np 4 launch that trains ``schedule``."""
    cache: dict[tuple[str, int], Launch] = {}

    def get(controller: str, schedule: str) -> Launch:
        group = next(n for n, names in enumerate(LAUNCHES[controller]) if schedule in names)
        if (controller, group) not in cache:
            runs = [f"{name}:{PER_COPY},{SCHEDULES[name]}" for name in LAUNCHES[controller][group]]
            cache[controller, group] = launch(
                4, controller, tmp_path_factory.mktemp(f"pipe4-{controller}-{group}"), runs)
        return cache[controller, group]

    return get


def whole_model(launched: Launch, run: str, ranks: list[int]) -> dict[str, np.ndarray]:
    """The parameters of one pipeline copy, from its stages' ranks (named by global layer)."""
    merged: dict[str, np.ndarray] = {}
    for rank in ranks:
        params, _ = launched.rank(run, rank)
        assert not merged.keys() & params.keys(), f"{run}: two stages hold the same layer"
        merged.update(params)
    return merged


def assert_same_model(got: dict[str, np.ndarray], want: dict[str, np.ndarray], atol: float) -> None:
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=atol, rtol=0, err_msg=key)


@pytest.mark.parametrize(("controller", "schedule"), ROWS)
def test_two_stages_by_two_copies_equal_one_process(four_ranks, reference, controller, schedule):
    launched = four_ranks(controller, schedule)
    want, _ = reference.rank("ref", 0)
    copy0, copy1 = whole_model(launched, schedule, [0, 1]), whole_model(launched, schedule, [2, 3])
    assert_same_model(copy0, want, ATOL)
    assert_same_model(copy1, copy0, 0.0)  # the copies of a stage hold identical parameters
    summary, ref = launched.summary(schedule), reference.summary("ref")
    assert summary["world_size"] == 4 and summary["steps"] == ref["steps"] == 23
    assert summary["pipeline"] == "2 stages x 2 copies"
    final, ref_final = summary["final"], ref["final"]
    assert final["eval_loss"] == pytest.approx(ref_final["eval_loss"], rel=1e-4)
    assert abs(final["eval_accuracy"] - ref_final["eval_accuracy"]) <= 1 / 360
    assert final["train_loss"] == pytest.approx(ref_final["train_loss"], rel=1e-4)


@pytest.mark.parametrize("schedule", LAUNCHES["gloo"][0])
def test_each_stage_reports_its_compute_wait_and_memory_and_the_bubble_is_measured(four_ranks, schedule):
    """Gloo's launch: every train record carries both stages' figures and the measured bubble
    (their sizes are timings, not asserted, beyond their ranges)."""
    path = four_ranks("gloo", schedule).out / schedule / "metrics.jsonl"
    records = [r for r in read_jsonl(path) if "step_time_median_s" in r]
    assert records
    for record in records:
        assert 0 <= record["bubble_fraction"] < 1
        for stage in (0, 1):
            assert record[f"stage_compute_s_stage{stage}"] > 0
            assert record[f"stage_wait_s_stage{stage}"] >= 0
            assert record[f"stage_rss_mb_stage{stage}"] > 0
            assert record[f"stage_activation_mb_stage{stage}"] > 0
        assert "stage_compute_s_stage2" not in record


def test_1f1b_holds_fewer_micro_batches_activations_on_the_first_stage(four_ranks):
    """Counted, not timed: the bytes autograd saved for backward passes still to come. At P = 2
    and m = 4, GPipe's first stage holds all 4 micro-batches' activations before its first
    backward pass; 1F1B's holds P = 2 in theory (PipeDream-Flush), and torch.distributed.pipelining
    frees part of a micro-batch's saved tensors one backward pass late (seen: 0.6 of GPipe's,
    docs/benchmarks.md): well under GPipe's, the same on every machine."""
    def peak(schedule: str) -> float:  # the last window's (the first includes torch's set-up)
        path = four_ranks("gloo", schedule).out / schedule / "metrics.jsonl"
        return [r for r in read_jsonl(path) if "stage_activation_mb_stage0" in r][-1][
            "stage_activation_mb_stage0"]
    assert peak("1f1b") / peak("gpipe") < 3 / 4


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_only_the_last_stage_reports_and_every_test_sample_counts_once(four_ranks, controller):
    launched = four_ranks(controller, "1f1b")
    counts = [launched.rank("1f1b", r)[1]["local_eval"]["count"] for r in range(4)]
    assert counts == [0, 180, 0, 180]


@pytest.mark.long
@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_two_stages_one_copy_equal_one_process(reference, tmp_path_factory, name):
    run = (f"{name}:data.batch_size=64,optim.lr=0.1,pipeline.stages=2,pipeline.microbatches=4,"
           f"{COMMON},{SCHEDULES[name]}")
    launch2 = launch(2, "gloo", tmp_path_factory.mktemp(f"pipe2-{name}"), [run])
    want, _ = reference.rank("ref", 0)
    assert_same_model(whole_model(launch2, name, [0, 1]), want, ATOL)
    assert launch2.summary(name)["pipeline"] == "2 stages x 1 copies"


STALL_S = 20  # the configured timeout of the lost-rank test: process groups and stall watchdog


@pytest.mark.timeout(600)
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_stage_rank_killed_ends_every_rank_nonzero(tmp_path, framework):
    """Without elastic mode, SIGKILL of stage 1 of copy 0 (rank 1) leaves rank 0 waiting on its
    send/receive (torch.distributed's, or Horovod's alltoall under TensorFlow), rank 3 (stage 1 of
    copy 1) in the stage's Horovod average and rank 2 on rank 3: every one must end, and the job
    exit nonzero, within the configured timeout (the bound below is generous: the stacks dump and
    horovodrun's teardown on 2 busy cores), never hang."""
    run = tmp_path / "run"
    cmd = [str(BIN / "horovodrun"), "-np", "4", "--gloo", str(Path(PYTHON).with_name("hvdtrain")),
           "train", str(CONFIGS[framework]), "train.epochs=200", "log.every_steps=5", "log.wandb=disabled",
           "pipeline.stages=2", "pipeline.microbatches=4", "checkpoint.enabled=false",
           "checkpoint.every_steps=0",
           f"train.stall_timeout_s={STALL_S}", f"log.dir={run}"]
    proc = subprocess.Popen(cmd, env=run_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for_records(run / "metrics.jsonl", 3, timeout=400)
        os.kill(pid_of_rank(1, str(run)), signal.SIGKILL)
        code = proc.wait(timeout=3 * STALL_S + 120)
    finally:
        proc.kill()
    assert code != 0
    assert not (run / "summary.json").exists()
