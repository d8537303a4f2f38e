"""The PyTorch trainer in one process (Horovod size 1, no launcher)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hvdtrain.driver import make_dataset, train
from hvdtrain.errors import HvdtrainError
from hvdtrain.torch.engine import TorchEngine
from tests.conftest import CONFIG, hvdtrain_cli, quiet_config, read_jsonl


def config(tmp_path, *overrides):
    return quiet_config(CONFIG, tmp_path, *overrides)


def test_trains_digits_to_the_bar_and_checkpoints_load(tmp_path):
    cfg = config(tmp_path)
    result = train(cfg)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == 45 * 15
    assert summary["final"]["eval_accuracy"] >= 0.95
    for key in ("framework", "epochs", "wall_time_s", "samples_per_sec"):
        assert key in summary
    assert summary["samples"] == 1437 * 15
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in ckpts] == ["step-00000500.ckpt", "step-00000600.ckpt", "step-00000675.ckpt"]
    fresh = TorchEngine(cfg, make_dataset(cfg))
    meta = fresh.load_state(ckpts[-1].read_bytes(), "test")
    assert meta["step"] == 675 and meta["config"] == cfg.to_dict()
    for key, value in result.engine.parameters().items():
        assert np.array_equal(fresh.parameters()[key], value)
    assert fresh.optimizer.state_dict()["state"]  # momentum buffers came back too


def test_accumulation_equals_the_larger_batch(tmp_path):
    big = train(config(tmp_path / "a", "data.batch_size=64", "train.epochs=2"))
    acc = train(config(tmp_path / "b", "data.batch_size=32", "train.backward_passes_per_step=2",
                       "train.epochs=2"))
    assert big.summary["steps"] == acc.summary["steps"] == 46
    for key, value in big.engine.parameters().items():
        np.testing.assert_allclose(acc.engine.parameters()[key], value, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name, options", [("tests.torch.user_models:tiny_net", "{width: 48}"),
                                           ("tests.torch.user_models:WideNet", "{width: 96}")])
def test_user_model_by_import_path(tmp_path, name, options):
    result = train(config(tmp_path, f"model.name={name}", f"model.options={options}",
                          "train.epochs=10"))
    assert result.summary["final"]["eval_accuracy"] >= 0.9
    first = next(iter(result.engine.parameters().values()))
    assert first.shape[0] == int(options.split()[-1].rstrip("}"))


@pytest.mark.parametrize("override, message", [
    ("model.name=resnet", "unknown torch model 'resnet'; known: gpt, hf_causal_lm, mlp"),
    ("model.name=tests.torch.user_models:nope", "has no attribute 'nope'"),
    ("model.name=tests.torch.user_models:tiny_net", "model.options for 'tests.torch.user_models:tiny_net': "
                                                    "got an unexpected keyword argument 'hidden'"),
    (("model.name=tests.torch.user_models:not_a_module", "model.options={}"),
     "build() must return a torch.nn.Module"),
    ("model.options={hidden: [0]}", "model.options.hidden=[0]: expected a list of positive integers"),
    ("model.options={depth: 3}", "unknown option(s) for mlp: depth"),
    ("data.name=mnist", "unknown dataset 'mnist'; known: digits"),
    ("data.options={bogus: 1}", "data.options for 'digits'"),
    ("data.options={test_fraction: 1.5}", "test_fraction=1.5: must be in (0, 1)"),
])
def test_bad_plugins_stop_before_anything_is_written(tmp_path, override, message):
    with pytest.raises(HvdtrainError) as err:
        train(config(tmp_path, *([override] if isinstance(override, str) else override)))
    assert message in str(err.value)
    assert not (tmp_path / "run").exists()


def test_cli_rejects_bad_values_with_exit_2_and_writes_nothing(tmp_path):
    proc = hvdtrain_cli("train", str(CONFIG), "optim.lr=abc", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "hvdtrain: error: optim.lr='abc': expected a number"
    assert list(tmp_path.iterdir()) == []


def test_cli_trains_and_refuses_to_mix_runs(tmp_path):
    args = ("train", str(CONFIG), "train.epochs=1", f"log.dir={tmp_path / 'run'}",
            "log.wandb=disabled")
    proc = hvdtrain_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "[hvdtrain] epoch 0 step" in proc.stdout and "eval_accuracy=" in proc.stdout
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 5  # steps 10..40 and the epoch end
    again = hvdtrain_cli(*args, "log.overwrite=false")
    assert again.returncode == 2 and "already holds a run" in again.stderr


def test_doctor_reports_horovod_build():
    proc = hvdtrain_cli("doctor")
    assert proc.returncode == 0, proc.stdout
    assert "horovod.torch" in proc.stdout and "gloo=yes, mpi=yes" in proc.stdout
    assert "all" in proc.stdout.splitlines()[-1]
