"""TensorFlow's checkpoint reader refuses foreign and damaged files with one line naming the file,
through the CLI and, property-based, in process; ``allow_pickle=False`` means nothing in them runs."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvdtrain.checkpoint import manifest_path
from hvdtrain.cli import EXIT_USAGE
from hvdtrain.driver import find_checkpoint, restore, train
from hvdtrain.errors import HvdtrainError
from hvdtrain.rundir import RunDir
from tests.conftest import TF_CONFIG, hvdtrain_cli, quiet_config

QUIET = ("log.console=false", "log.wandb=disabled", "log.tensorboard=false")


class RunsCode:
    """Unpickling this would run a shell command: the test for "nothing in the file runs"."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def with_manifest(path: Path, data: bytes) -> Path:
    """Writes ``data`` to ``path`` with a manifest that matches it, as if hvdtrain had written it."""
    path.write_bytes(data)
    manifest_path(path).write_text(json.dumps({"file": path.name, "bytes": len(data), "step": 1,
                                               "sha256": hashlib.sha256(data).hexdigest()}))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An engine that trained (to restore into) and the checkpoint hvdtrain wrote (to damage)."""
    tmp = tmp_path_factory.mktemp("real")
    result = train(quiet_config(TF_CONFIG, tmp, "train.max_steps=3"))
    return result.engine, sorted((tmp / "run" / "checkpoints").glob("*.ckpt"))[-1]


def npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_resume_from_an_npz_without_hvdtrains_entries_is_one_line_naming_it(tmp_path):
    path = with_manifest(tmp_path / "foreign.ckpt", npz(weights=np.ones(3)))
    proc = hvdtrain_cli("train", str(TF_CONFIG), f"log.dir={tmp_path / 'run'}", *QUIET,
                        f"checkpoint.resume={path}")
    assert proc.returncode == EXIT_USAGE, proc.stderr[-3000:]
    # TensorFlow's own start-up notes come before; hvdtrain's error is the one last line.
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1:] == [
        f"hvdtrain: error: checkpoint {path} is not an hvdtrain checkpoint or is damaged (KeyError: "
        "'meta'); point checkpoint.resume at a step-*.ckpt file that "
        "hvdtrain wrote"]


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=2048), cut=st.floats(0.0, 0.999),
       payload=st.sampled_from(["bytes", "truncated", "pickle", "object array", "wrong entries"]))
def test_the_reader_never_runs_code_and_always_gives_one_line(trained, tmp_path, data, cut, payload):
    engine, real_checkpoint = trained
    real = real_checkpoint.read_bytes()
    marker = tmp_path / "ran"
    content = {"bytes": data, "truncated": real[:int(len(real) * cut)],
               "pickle": pickle.dumps([RunsCode(marker), data]),
               "object array": npz(meta=np.array([{"x": 1}], dtype=object)),
               "wrong entries": npz(meta=np.array(json.dumps({"position": 1})), **{"model/0": np.ones(2)})
               }[payload]
    path = with_manifest(tmp_path / "step-00000001.ckpt", content)
    cfg = quiet_config(TF_CONFIG, tmp_path, f"checkpoint.resume={path}")
    with pytest.raises(HvdtrainError) as caught:
        restore(engine, find_checkpoint(cfg, RunDir(cfg.run_dir)), cfg)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    assert not marker.exists()
