"""``hvdtrain export``'s one-line refusals, checked before any framework is imported: a directory
that is no run, a run without a valid checkpoint, a format the run's model cannot take."""

from __future__ import annotations

import pytest

from hvdtrain.cli import main
from hvdtrain.config import save_config
from tests.conftest import CONFIG, quiet_config


@pytest.fixture
def run(tmp_path):
    cfg = quiet_config(CONFIG, tmp_path)
    (tmp_path / "run").mkdir()
    save_config(cfg, tmp_path / "run" / "config.yaml")
    return tmp_path / "run"


def _error(capsys, *argv: str) -> str:
    assert main(["export", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_a_run_without_a_checkpoint_is_one_line(run, capsys):
    err = _error(capsys, str(run), "--format", "safetensors")
    assert f"export: {run} has no valid checkpoint in {run / 'checkpoints'}" in err


def test_a_directory_that_is_no_run_is_one_line(tmp_path, capsys):
    assert f"export: {tmp_path} is not a run directory (no config.yaml)" in \
        _error(capsys, str(tmp_path), "--format", "hf")


def test_hf_format_needs_the_hf_model(run, capsys):
    (run / "checkpoints").mkdir()
    # A checkpoint that verifies: its manifest holds its sha256 (hvdtrain/checkpoint.py).
    from hvdtrain.checkpoint import manifest_path, sha256_of

    ckpt = run / "checkpoints" / "step-00000001.ckpt"
    ckpt.write_bytes(b"x")
    manifest_path(ckpt).write_text(f'{{"sha256": "{sha256_of(ckpt)}", "bytes": 1}}')
    err = _error(capsys, str(run), "--format", "hf")
    assert "export --format=hf: the run's model is 'mlp'; only model.name=hf_causal_lm" in err


def test_a_format_of_the_other_framework_is_one_line(run, capsys):
    (run / "checkpoints").mkdir()
    from hvdtrain.checkpoint import manifest_path, sha256_of

    ckpt = run / "checkpoints" / "step-00000001.ckpt"
    ckpt.write_bytes(b"x")
    manifest_path(ckpt).write_text(f'{{"sha256": "{sha256_of(ckpt)}", "bytes": 1}}')
    err = _error(capsys, str(run), "--format", "keras")
    assert "export --format=keras: runs of framework=torch export to safetensors, hf" in err
