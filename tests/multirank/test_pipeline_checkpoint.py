"""Pipeline checkpoints that do not depend on the split, under horovodrun (Gloo).

One launch sequence for PyTorch, on the digits MLP with three hidden layers (eight layers, four
with parameters): at ``-np 4`` (2 stages x 2 copies) a run writes checkpoints in parts every 10
steps; a run resumed from its step 10 with the same split ends bit-identical to it, one resumed
with another split, and one at 4 stages x 1 copy (another number of stages and of copies), agree
within ``ATOL``; at ``-np 1`` (no stages) a run resumed from the same parted checkpoint agrees too,
and a run without stages writes an ordinary checkpoint; at ``-np 2`` (2 stages, one copy) a run
resumed from that ordinary checkpoint agrees with it. TensorFlow with Adam: the same four checks
at ``-np 2`` (2 stages) and ``-np 1``, and ``hvdtrain export`` of the run in parts to ``.keras``
and ``.weights.h5`` (in this process, from the first launch's run). A stop signal to one stage of
a PyTorch pipeline stops both after the same step with a checkpoint in parts, from which a run
without stages finishes.

`make test` runs each framework's first launch (the same, another split and, in PyTorch, another
number of stages and copies, and a misfit checkpoint refused) and the stop signal; the launches
without stages and from a whole checkpoint are `long` (about 30 s of make test, estimated): it has
those resumes in both frameworks in test_pipeline_compression.py and
test_pipeline_tf_compression.py (data parallel from a pipeline's parts, a pipeline from a data
parallel checkpoint, with the exchange's state).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import keras  # at collection, as in test_kerashub.py: importing TensorFlow sets variables
import numpy as np
import pytest
import yaml

from hvdtrain.checkpoint import parts_of, verify
from hvdtrain.data.digits import DigitsDataset
from hvdtrain.export import export
from hvdtrain.tensorflow.export import FILES  # (its package sets TF_CPP_MIN_LOG_LEVEL)
from tests.conftest import BIN, CONFIG, TF_CONFIG, horovodrun, hvdtrain_cli, read_jsonl, run_env
from tests.multirank.conftest import PYTHON, WORKER, Launch
from tests.multirank.test_pipeline import launch, whole_model
from tests.multirank.test_pipeline_tf import stage_params
from tests.multirank.test_stop_resume import pid_of_rank

ATOL = 1e-5  # float32 sums in another order (another split, no stages) over 13 steps
COMMON = ("train.epochs=1,optim.warmup_steps=0,log.every_steps=5,pipeline.microbatches=4,"
          "train.stall_timeout_s=120,checkpoint.every_steps=10,checkpoint.keep=3")
PIPE = "data.batch_size=32,optim.lr=0.05,pipeline.stages=2," + COMMON  # at -np 4: 2 copies
WHOLE = ("data.batch_size=64,optim.lr=0.1," + COMMON  # the same global batch, no stages
         + ",pipeline.microbatches=0")  # (no micro-batches without stages: refused)
OTHER_SPLIT = "pipeline.split=[4]"  # layers 0-3 on stage 0; `auto` puts 0-2 there
HIDDEN = (32, 32, 32)  # flatten, fc1, relu1, fc2, relu2, fc3, relu3, head: 4 stages can split it
FOUR = "data.batch_size=64,optim.lr=0.1,pipeline.stages=4," + COMMON
"""4 stages x 1 copy on the global batch of 64: `auto` gives each a layer with parameters."""


def step(out: Path, run: str, number: int) -> str:
    """The override that resumes from checkpoint ``number`` of run ``run`` under ``out``."""
    return f"checkpoint.resume={out / run / 'checkpoints' / f'step-{number:08d}.ckpt'}"


def step10(out: Path, run: str) -> str:
    return step(out, run, 10)


def assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], atol: float) -> None:
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=atol, rtol=0, err_msg=key)


@pytest.fixture(scope="module")
def torch_parts(tmp_path_factory) -> tuple[Path, Launch]:
    """PyTorch's -np 4 launch: the run in parts and its resumes (its folder and launch)."""
    four = tmp_path_factory.mktemp("np4")
    return four, launch(4, "gloo", four, [
        f"full:{PIPE}",
        f"same:{PIPE},{step10(four, 'full')}",
        f"other:{PIPE},{OTHER_SPLIT},{step10(four, 'full')}",
        f"four:{FOUR},{step10(four, 'full')}"], hidden=HIDDEN)


@pytest.mark.timeout(1200)  # slow on busy shared cores
def test_torch_resumes_in_parts_with_any_split_or_number_of_stages(torch_parts, tmp_path):
    four, launched4 = torch_parts
    ckpts = four / "full" / "checkpoints"
    manifest = json.loads((ckpts / "step-00000010.json").read_text())
    assert [p["file"] for p in manifest["parts"]] == ["step-00000010.stage-0.part",
                                                      "step-00000010.stage-1.part"]
    assert [p["layers"] for p in manifest["parts"]] == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert sorted(p.name for p in ckpts.glob("*.part")) == [
        f"step-000000{s}.stage-{k}.part" for s in (10, 20, 23) for k in (0, 1)]
    full = whole_model(launched4, "full", [0, 1])
    # Same split: bit-identical parameters and training loss to the uninterrupted run.
    for ranks in ([0, 1], [2, 3]):
        assert_close(whole_model(launched4, "same", ranks), full, 0.0)
    assert launched4.summary("same")["final"] == launched4.summary("full")["final"]
    assert launched4.summary("same")["steps"] == 23
    assert read_jsonl(four / "same" / "metrics.jsonl")[0]["step"] == 15  # it resumed at 10
    assert_close(whole_model(launched4, "other", [0, 1]), full, ATOL)
    assert launched4.rank("other", 0)[0].keys() == {"1.weight", "1.bias", "3.weight", "3.bias"}
    # 2 stages x 2 copies -> 4 stages x 1 copy: each rank reads the parts that hold its layers.
    assert launched4.summary("four")["pipeline"] == "4 stages x 1 copies"
    assert [sorted(launched4.rank("four", r)[0]) for r in range(4)] == [
        [f"{layer}.{kind}" for kind in ("bias", "weight")] for layer in (1, 3, 5, 7)]
    assert_close(whole_model(launched4, "four", [0, 1, 2, 3]), full, ATOL)
    assert read_jsonl(four / "four" / "metrics.jsonl")[0]["step"] == 15  # it resumed at 10
    assert launched4.summary("four")["steps"] == 23

    # Parts of another model: a one-line error (exit 2) before anything trains.
    other = hvdtrain_cli("train", str(CONFIG), "model.options.hidden=[16]", "log.wandb=disabled",
                         f"log.dir={tmp_path / 'misfit'}", step10(four, "full"))
    assert other.returncode == 2, other.stderr[-2000:]
    assert "does not fit the model" in other.stderr and "step-00000010.ckpt" in other.stderr


@pytest.mark.long
@pytest.mark.timeout(1200)  # three launches; slow on busy shared cores
def test_torch_resumes_without_stages_and_from_a_whole_checkpoint(torch_parts, tmp_path):
    four, launched4 = torch_parts
    full = whole_model(launched4, "full", [0, 1])
    one = tmp_path / "np1"
    launched1 = launch(1, "gloo", one, [f"none:{WHOLE},{step10(four, 'full')}", f"whole:{WHOLE}"],
                       hidden=HIDDEN)
    assert_close(launched1.rank("none", 0)[0], full, ATOL)
    assert not list((one / "whole" / "checkpoints").glob("*.part"))

    two = tmp_path / "np2"
    launched2 = launch(2, "gloo", two, [
        f"from_whole:data.batch_size=64,optim.lr=0.1,pipeline.stages=2,{COMMON},"
        f"{step10(one, 'whole')}"], hidden=HIDDEN)
    assert_close(whole_model(launched2, "from_whole", [0, 1]), launched1.rank("whole", 0)[0], ATOL)
    final = launched2.summary("from_whole")["final"]
    assert abs(final["train_loss"] - launched1.summary("whole")["final"]["train_loss"]) < 1e-4


TF_COMMON = ("optim.name=adam,optim.lr=0.01,optim.scale_lr=false,"
             "optim.warmup_steps=0,train.epochs=1,data.batch_size=32,checkpoint.every_steps=20,"
             "checkpoint.keep=3")
TF_PIPE = TF_COMMON + ",pipeline.stages=2,pipeline.microbatches=4,pipeline.schedule=1f1b"


def tf_launch(np_: int, out: Path, runs: list[str]) -> Launch:
    """The multirank worker under horovodrun on the Keras digits MLP with hidden layers of 32
    and 16 (four layers)."""
    out.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load(TF_CONFIG.read_text())
    config["model"]["options"]["hidden"] = [32, 16]
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    proc = horovodrun(np_, "gloo", [PYTHON, WORKER, str(out), str(out / "config.yaml"), *runs],
                      timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return Launch("tensorflow", "gloo", out)


def tf_whole(launched: Launch, run: str) -> list[np.ndarray]:
    """A run's parameters without stages (named by position), in order."""
    params = launched.rank(run, 0)[0]
    return [params[k] for k in sorted(params, key=lambda n: int(n.split(".")[0]))]


def assert_same_list(got: list[np.ndarray], want: list[np.ndarray], atol: float) -> None:
    assert [p.shape for p in got] == [p.shape for p in want]
    for mine, theirs in zip(got, want, strict=True):
        np.testing.assert_allclose(mine, theirs, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def tf_parts(tmp_path_factory) -> tuple[Path, Launch]:
    """TensorFlow's -np 2 launch: the run in parts and its resumes (its folder and launch)."""
    two = tmp_path_factory.mktemp("np2")
    return two, tf_launch(2, two, [
        f"full:{TF_PIPE}", f"same:{TF_PIPE},{step(two, 'full', 20)}",
        f"other:{TF_PIPE},pipeline.split=[3],{step(two, 'full', 20)}"])


@pytest.mark.timeout(1200)  # TensorFlow's start-up is most of each launch
def test_tensorflow_resumes_in_parts_with_any_split(tf_parts):
    """The same checks with Keras 3 and Adam (its slots by global name) at -np 2 (2 stages)."""
    two, launched2 = tf_parts
    manifest = json.loads((two / "full" / "checkpoints" / "step-00000020.json").read_text())
    assert [p["layers"] for p in manifest["parts"]] == [[0, 1], [2, 3]]
    full = stage_params(launched2, "full", [0, 1])
    assert_same_list(stage_params(launched2, "same", [0, 1]), full, 0.0)
    assert launched2.summary("same")["final"] == launched2.summary("full")["final"]
    assert read_jsonl(two / "same" / "metrics.jsonl")[0]["step"] == 30  # it resumed at 20
    assert len(launched2.rank("other", 1)[0]) == 2  # split [3]: the head alone on stage 1
    assert_same_list(stage_params(launched2, "other", [0, 1]), full, ATOL)


@pytest.mark.timeout(600)
def test_a_tensorflow_run_in_parts_exports_to_keras_with_the_trained_logits(tf_parts):
    """``hvdtrain export`` of the 2-stage run (its newest checkpoint, step 45, in two parts):
    the ``.keras`` file holds the stages' final parameters and gives the eval loss and accuracy
    that the stages reported; ``.weights.h5`` loaded into a model of other weights gives the
    same logits."""
    two, launched2 = tf_parts
    run = two / "full"
    manifest = json.loads((run / "checkpoints" / "step-00000045.json").read_text())
    assert [p["layers"] for p in manifest["parts"]] == [[0, 1], [2, 3]]
    final = stage_params(launched2, "full", [0, 1])
    loaded = keras.saving.load_model(export(str(run), "keras") / FILES["keras"])
    assert_same_list([np.asarray(v) for v in loaded.trainable_variables], final, 0.0)
    test = DigitsDataset().test()
    logits = np.asarray(loaded(test.x, training=False), np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    losses = np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(test.y)), test.y]
    reported = launched2.summary("full")["final"]
    assert float(losses.mean()) == pytest.approx(reported["eval_loss"], rel=1e-4)
    assert float((logits.argmax(axis=1) == test.y).mean()) == pytest.approx(
        reported["eval_accuracy"], abs=1e-9)

    weights = export(str(run), "weights.h5") / FILES["weights.h5"]
    keras.utils.set_random_seed(2)
    other = keras.models.clone_model(loaded)  # fresh weights: the file must set them all
    assert np.abs(np.asarray(other(test.x, training=False)) - logits).max() > 1e-3
    other.load_weights(weights)
    np.testing.assert_allclose(np.asarray(other(test.x, training=False)), logits, rtol=0,
                               atol=1e-5)


@pytest.mark.long
@pytest.mark.timeout(1200)  # TensorFlow's start-up is most of each launch
def test_tensorflow_resumes_without_stages_and_from_a_whole_checkpoint(tf_parts, tmp_path):
    two, launched2 = tf_parts
    full = stage_params(launched2, "full", [0, 1])
    one = tmp_path / "np1"
    launched1 = tf_launch(1, one, [
        f"none:{TF_COMMON},{step(two, 'full', 20)}", f"whole:{TF_COMMON}"])
    assert_same_list(tf_whole(launched1, "none"), full, ATOL)

    again = tmp_path / "np2-from-whole"
    launched = tf_launch(2, again, [f"from_whole:{TF_PIPE},{step(one, 'whole', 20)}"])
    assert_same_list(stage_params(launched, "from_whole", [0, 1]), tf_whole(launched1, "whole"),
                     ATOL)


@pytest.mark.timeout(600)
def test_a_stop_signal_to_one_stage_checkpoints_in_parts_and_resumes_without_stages(tmp_path):
    """SIGUSR1 to stage 1 stops both stages after the same step, with a checkpoint in parts that
    verifies; a run without stages resumes from it (``resume=auto``) and finishes the epoch after
    the stop (the pipeline was told 20 epochs only so that it cannot end before the signal)."""
    run = tmp_path / "run"
    args = [str(CONFIG), "log.every_steps=5", "log.wandb=disabled", f"log.dir={run}",
            "checkpoint.every_steps=10"]
    proc = subprocess.Popen(
        [str(BIN / "horovodrun"), "-np", "2", "--gloo", str(Path(PYTHON).with_name("hvdtrain")),
         "train", *args, "train.epochs=20", "pipeline.stages=2", "pipeline.microbatches=4"],
        env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # A checkpoint's manifest, written by the ranks (metrics.jsonl is written by a process in the
    # idle class, which two busy ranks on 2 cores starve); any: checkpoint.keep removes old ones.
    deadline = time.monotonic() + 300
    while not list((run / "checkpoints").glob("step-*.json")):
        assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint written"
        time.sleep(0.2)
    os.kill(pid_of_rank(1, str(run)), signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    # The rank that exits first exits 75 (stopped on request: resume later); horovodrun then
    # terminates the other (143) if it has not exited yet, and itself exits nonzero.
    codes = dict(re.findall(r"Process (\d) exit with status code (\d+)", out + err))
    first = re.search(r"after failure of Process (\d)", out + err)
    assert proc.returncode != 0 and first and codes[first.group(1)] == "75", out[-2000:] + err[-2000:]
    assert set(codes.values()) <= {"75", "143"}, codes
    stops = re.findall(r"\[(\d)\]<stderr>:hvdtrain: stopped on request at step (\d+)", out + err)
    assert sorted(rank for rank, _ in stops) == ["0", "1"], out[-2000:] + err[-2000:]
    assert stops[0][1] == stops[1][1]
    stopped = int(stops[0][1])
    ckpt = run / "checkpoints" / f"step-{stopped:08d}.ckpt"
    assert verify(ckpt) is None and len(parts_of(ckpt)) == 2
    assert not (run / "summary.json").exists()

    epochs = max(3, stopped // 45 + 1)  # 45 steps an epoch (1,437 samples, batch 32)
    resumed = subprocess.run([str(BIN / "hvdtrain"), "train", *args, f"train.epochs={epochs}",
                              "checkpoint.resume=auto"],
                             env=run_env(), capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["samples"] == epochs * 1437 and summary["world_size"] == 1
    assert summary["steps"] == epochs * 45
    logged = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "step_time_median_s" in r]
    assert logged == sorted(set(logged)) and logged[-1] == epochs * 45, logged
    assert summary["final"]["eval_accuracy"] >= 0.9
