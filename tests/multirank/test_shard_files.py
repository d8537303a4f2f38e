"""Checkpoints of sharded data parallel written by every rank (``shard.stage`` 1-3, PyTorch;
docs/sharding.md): each rank writes its own shards, rank 0 the rest and the manifest; a run
resumes from them bit for bit, at another stage, on the ring, at another number of ranks, and
the export reads them one tensor at a time.

One launch under Gloo (-np 2): stage 3 with AdamW (2 micro-batches a step, one epoch of 23
steps, a checkpoint every 12), stage 3 resumed from its step-12 checkpoint, stage 1 and the
ring resumed from it. Marked ``long``: a stage-2 run's checkpoint resumed at one rank (the ring,
stage 3) and at four (stages 1 and 2), and a stop signal to a stage-3 run resumed at one rank.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from hvdtrain.checkpoint import verify
from hvdtrain.export import export
from tests.conftest import BIN, CONFIG, run_env
from tests.multirank.conftest import PYTHON, Launch, launch_worker
from tests.multirank.test_stop_resume import pid_of_rank, wait_for_records

RUN = ("data.batch_size={b},train.backward_passes_per_step=2,train.epochs=1,"
       "optim.warmup_steps=0,optim.name=adamw,optim.lr={lr},optim.weight_decay=0.01,"
       "checkpoint.every_steps=12")
TWO = RUN.format(b=16, lr=0.002)
"""2 ranks of 16 samples; the global batch and rate (optim.scale_lr) of the runs below."""
TOLERANCE = 1e-5
"""Another stage, the ring or another number of ranks adds in another order (seen: 1.5e-8
after 11 more AdamW steps); one step more or less moves 1e-3 to 1e-2."""


def ckpt(out: Path, run: str, step: int) -> Path:
    return out / run / "checkpoints" / f"step-{step:08d}.ckpt"


@pytest.fixture(scope="session")
def shard_files(tmp_path_factory) -> Launch:
    """The launch the module docstring describes; launched once."""
    out = tmp_path_factory.mktemp("shard-files")
    at12 = ckpt(out, "s3", 12)
    return launch_worker(2, "gloo", "torch", out, [
        f"s3:{TWO},shard.stage=3", f"s3_resumed:{TWO},shard.stage=3,checkpoint.resume={at12}",
        f"s1_from_s3:{TWO},shard.stage=1,checkpoint.resume={at12}",
        f"ring_from_s3:{TWO},checkpoint.resume={at12}"])


def assert_near(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert got.keys() == want.keys() and len(got) == 4, what
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=TOLERANCE, rtol=0, err_msg=what)


def resumed_at(out: Path, run: str, step: int) -> None:
    """The run started after ``step`` (it did not train the first steps again)."""
    steps = [json.loads(line)["step"] for line in (out / run / "metrics.jsonl").read_text()
             .splitlines() if "step" in json.loads(line)]
    assert steps and min(steps) > step, run


def test_every_rank_writes_its_own_shards_under_one_manifest(shard_files):
    directory = shard_files.out / "s3" / "checkpoints"
    manifest = json.loads((directory / "step-00000012.json").read_text())
    assert [(p["file"], p["shard"], p["of"]) for p in manifest["parts"]] == [
        ("step-00000012.rank-0.part", 0, 2), ("step-00000012.rank-1.part", 1, 2)]
    # Each part holds its rank's half of each unit (8,320 and 1,290 elements: 4,160 and 645),
    # of the parameters and of AdamW's two moments; rank 0's file no trainable parameter.
    for rank in (0, 1):
        tensors = load_file(str(directory / f"step-00000012.rank-{rank}.part"))
        assert {k: v.shape for k, v in tensors.items()} == {
            f"u{u}.{kind}": (n,) for u, n in ((0, 4160), (1, 645))
            for kind in ("params", "exp_avg", "exp_avg_sq")}
    state = torch.load(directory / "step-00000012.ckpt", weights_only=True)
    assert state["model"] == {} and state["optimizer"]["state"] == {}
    assert state["shards"]["shards"] == 2 and state["shards"]["stage"] == 3
    # A damaged part makes the whole checkpoint invalid.
    copy = shard_files.out / "damaged"
    shutil.copytree(directory, copy)
    assert verify(copy / "step-00000012.ckpt") is None
    with (copy / "step-00000012.rank-1.part").open("r+b") as part:
        part.seek(-4, 2)
        part.write(b"\x00\x01\x02\x03")
    assert "step-00000012.rank-1.part: sha256 differs" in verify(copy / "step-00000012.ckpt")


def test_a_stage_three_run_resumes_bit_for_bit(shard_files):
    for rank in (0, 1):
        whole, _ = shard_files.rank("s3", rank)
        resumed, _ = shard_files.rank("s3_resumed", rank)
        assert whole.keys() == resumed.keys() and len(whole) == 4
        for key in whole:
            assert np.array_equal(resumed[key], whole[key]), f"rank {rank}: {key}"
    resumed_at(shard_files.out, "s3_resumed", 12)


def test_a_stage_three_checkpoint_resumes_at_stage_one_and_on_the_ring(shard_files):
    want = shard_files.rank("s3", 0)[0]
    for run in ("s1_from_s3", "ring_from_s3"):
        for rank in (0, 1):
            assert_near(shard_files.rank(run, rank)[0], want, f"{run}, rank {rank}")
        resumed_at(shard_files.out, run, 12)


def test_the_export_holds_the_model(shard_files):
    out = export(str(shard_files.out / "s3"), "safetensors")
    tensors = load_file(str(out / "model.safetensors"))
    want = shard_files.rank("s3", 0)[0]
    assert tensors.keys() == want.keys()
    for key in want:
        assert np.array_equal(tensors[key], want[key]), key


@pytest.mark.long
@pytest.mark.parametrize("ranks", [1, 4])
def test_a_stage_two_checkpoint_resumes_at_one_rank_and_at_four(shard_files, tmp_path_factory,
                                                                 ranks):
    """A 2-rank stage-2 run's step-12 checkpoint: at one rank on the ring and at stage 3, at
    four ranks at stages 1 and 2 (the same global batch and rate)."""
    out = tmp_path_factory.mktemp(f"shard-files-{ranks}")
    two = launch_worker(2, "gloo", "torch", out, [f"s2:{TWO},shard.stage=2"])
    at12 = ckpt(out, "s2", 12)
    run = RUN.format(b=32 // ranks, lr=0.004 / ranks)
    stages = (0, 3) if ranks == 1 else (1, 2)
    launch = launch_worker(ranks, "gloo", "torch", out, [
        f"s{k}_at_{ranks}:{run},shard.stage={k},checkpoint.resume={at12}" for k in stages])
    want = two.rank("s2", 0)[0]
    assert_near(want, shard_files.rank("s3", 0)[0], "stage 2 against stage 3")
    for k in stages:
        for rank in range(ranks):
            assert_near(launch.rank(f"s{k}_at_{ranks}", rank)[0], want, f"stage {k}, rank {rank}")
        resumed_at(out, f"s{k}_at_{ranks}", 12)


@pytest.mark.long
def test_a_stop_signal_to_a_stage_three_run_checkpoints_its_shards_and_resumes(tmp_path):
    """SIGUSR1 to one rank of a stage-3 run: both stop at the same step with a checkpoint of
    shards, which one rank resumes at stage 1 to the end of every epoch."""
    run = tmp_path / "run"
    args = [str(CONFIG), "train.epochs=10", "log.every_steps=5", "log.wandb=disabled",
            f"log.dir={run}"]
    proc = subprocess.Popen([str(BIN / "horovodrun"), "-np", "2", "--gloo",
                             str(Path(PYTHON).with_name("hvdtrain")), "train", *args,
                             "shard.stage=3"], env=run_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_records(run / "metrics.jsonl", 3)
    os.kill(pid_of_rank(1, str(run)), signal.SIGUSR1)
    stdout, stderr = proc.communicate(timeout=300)
    stops = re.findall(r"\[(\d)\]<stderr>:hvdtrain: stopped on request at step (\d+)",
                       stdout + stderr)
    assert sorted(rank for rank, _ in stops) == ["0", "1"], stdout[-2000:] + stderr[-2000:]
    step = int(stops[0][1])
    manifest = json.loads((run / "checkpoints" / f"step-{step:08d}.json").read_text())
    assert [p["shard"] for p in manifest["parts"]] == [0, 1]
    resumed = subprocess.run([str(BIN / "hvdtrain"), "train", *args, "checkpoint.resume=auto",
                              "shard.stage=1"], env=run_env(), capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["samples"] == 10 * 1437
    assert summary["final"]["eval_accuracy"] >= 0.9
