"""Failures of the environment and of foreign files, through the CLI as a user runs it: one line on
stderr, exit code 2 (the user's mistake) or 74 (the environment), nothing already saved harmed.

Mounts (a small tmpfs, a read-only bind) need root, as the test machines and CI run; without root
the tests that mount are skipped, saying so (``make test-fast`` runs without root).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import re
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvdtrain.checkpoint import manifest_path, verify
from hvdtrain.cli import EXIT_ENVIRONMENT, EXIT_USAGE
from hvdtrain.driver import find_checkpoint, restore, train
from hvdtrain.errors import EnvironmentFailure, HvdtrainError
from hvdtrain.observe.writer import SinkProcess
from hvdtrain.rundir import RunDir, read_records
from tests.conftest import BIN, CONFIG, horovodrun, hvdtrain_cli, quiet_config, read_jsonl

QUIET = ("log.console=false", "log.wandb=disabled", "log.tensorboard=false")
# The model is pinned so that a checkpoint's size (about 96 kB) fits the tmpfs below once, not twice.
SMALL = ("model.options.hidden=[128]", "train.max_steps=50", "checkpoint.every_steps=10",
         "log.every_steps=2")


def _ran(marker: str) -> None:
    """What a foreign pickle asks to run on load; it must never be called."""
    Path(marker).touch()


class RunsCode:
    """Unpickling this calls :func:`_ran`: the test for "no code from the file runs"."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return _ran, (self.marker,)


def can_mount() -> bool:
    """Whether this process may mount: CAP_SYS_ADMIN (bit 21) among its effective capabilities, as
    root has on the test machines and in CI, and neither a user nor root without it has."""
    status = Path("/proc/self/status").read_text()
    return bool(int(status.split("CapEff:")[1].split()[0], 16) >> 21 & 1)


MOUNTS = pytest.mark.skipif(not can_mount(), reason="mounts a file system, which needs root")


@contextlib.contextmanager
def mounted(target: Path, *options: str, source: str = "tmpfs"):
    """``mount`` for the duration of the block (``-t tmpfs`` or ``--bind``)."""
    target.mkdir(parents=True, exist_ok=True)
    kind = ["--bind", source] if source != "tmpfs" else ["-t", "tmpfs", "tmpfs"]
    subprocess.run(["mount", *kind, str(target)], check=True)
    try:
        for option in options:
            subprocess.run(["mount", "-o", f"remount,{option}" + (",bind" if source != "tmpfs" else ""),
                            str(target)], check=True)
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


def one_line(proc: subprocess.CompletedProcess, code: int) -> str:
    """The one error line of a run that exited with ``code``."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hvdtrain: error: "), proc.stderr[-3000:]
    return lines[0].removeprefix("hvdtrain: error: ")


def test_log_dir_naming_a_file_is_a_user_error(tmp_path):
    target = tmp_path / "afile"
    target.write_text("mine\n")
    line = one_line(hvdtrain_cli("train", str(CONFIG), f"log.dir={target}", *QUIET), EXIT_USAGE)
    assert line == (f"log.dir: cannot write the run directory {str(target)!r}: File exists (EEXIST); "
                    "log.dir must name a directory (or where one can be made)")
    assert target.read_text() == "mine\n"


@MOUNTS
def test_log_dir_on_a_read_only_file_system_is_an_environment_failure(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    with mounted(tmp_path / "ro", "ro", source=str(source)) as readonly:
        run = readonly / "run"
        line = one_line(hvdtrain_cli("train", str(CONFIG), f"log.dir={run}", *QUIET), EXIT_ENVIRONMENT)
    assert line == (f"log.dir: cannot write the run directory {str(run)!r}: Read-only file system "
                    "(EROFS); choose a writable log.dir, or fix its permissions or free space")


@MOUNTS
def test_a_disk_that_fills_stops_the_run_and_resume_continues_after_space_is_freed(tmp_path):
    with mounted(tmp_path / "disk", "size=160k") as disk:
        run = disk / "run"
        args = ("train", str(CONFIG), f"log.dir={run}", *QUIET, *SMALL)
        line = one_line(hvdtrain_cli(*args), EXIT_ENVIRONMENT)
        failed = RunDir(run).checkpoints / "step-00000020.ckpt"
        assert line == (f"cannot write checkpoint {str(failed)!r}: No space left on device (ENOSPC); "
                        "the last valid checkpoint is step-00000010.ckpt; free space (or fix the "
                        "directory), then resubmit with checkpoint.resume=auto")
        # The partial file is gone, the last valid checkpoint is whole, the metrics are readable.
        names = sorted(p.name for p in RunDir(run).checkpoints.iterdir())
        assert names == ["step-00000010.ckpt", "step-00000010.json"]
        assert verify(RunDir(run).checkpoints / names[0]) is None
        steps = [r["step"] for r in read_jsonl(RunDir(run).metrics)]
        assert steps[:10] == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20] and steps[-1] < 30
        assert not (run / "summary.json").exists()

        subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)  # space freed
        resumed = hvdtrain_cli(*args, "checkpoint.resume=auto")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == 50
        steps = [r["step"] for r in read_jsonl(RunDir(run).metrics)]
        # Each step once (records after step 10 were trimmed and logged again), to the end.
        assert steps == sorted(set(steps)) and steps[-1] == 50 and {10, 12, 30} <= set(steps)


@MOUNTS
def test_a_disk_that_fills_under_metrics_stops_every_rank_and_resume_finishes(tmp_path):
    # The run directory on a disk of four pages (the config, the two ranks' watchdog files and one
    # page of records), its checkpoints on a disk of their own: metrics.jsonl is what fails.
    args = ["train", str(CONFIG), *QUIET, "train.max_steps=60", "checkpoint.every_steps=3",
            "log.every_steps=1", "log.jsonl_every_s=0"]
    with mounted(tmp_path / "disk", "size=16k") as disk, \
            mounted(RunDir(disk / "run").checkpoints, "size=4m"):
        run = RunDir(disk / "run")
        args.append(f"log.dir={run.root}")
        # Each rank's own exit status, as the shell that horovodrun starts sees it. horovodrun sends
        # SIGTERM to the other ranks once the first has exited (docs/elastic.md, "Exit codes"),
        # which would hide the status of a rank still on its way out; the shell has it ignored.
        script = " ".join(map(shlex.quote, [str(BIN / "hvdtrain"), *args]))
        proc = horovodrun(2, "gloo", ["sh", "-c", f"trap '' TERM; {script}; s=$?; "
                                      'echo "rank $HOROVOD_RANK exit $s" >&2; exit $s'])
        out = proc.stdout + proc.stderr
        assert dict(re.findall(r"^\[\d\]<stderr>:rank (\d) exit (\d+)$", out, re.M)) == \
            {"0": str(EXIT_ENVIRONMENT), "1": str(EXIT_ENVIRONMENT)}, out[-3000:]
        errors = re.findall(r"^\[(\d)\]<stderr>:hvdtrain: error: (.*)$", out, re.M)
        assert sorted(rank for rank, _ in errors) == ["0", "1"], out[-3000:]  # one line each
        assert {line for _, line in errors} == {
            f"cannot write metrics {str(run.metrics)!r}: No space left on device (ENOSPC); free space "
            "(or fix the directory), then resubmit with checkpoint.resume=auto"}
        # The records written stay whole (the failed write was cut back), a checkpoint is valid.
        assert run.metrics.read_text().endswith("\n")
        steps = [r["step"] for r in read_records(run.metrics)]
        assert steps == list(range(1, len(steps) + 1)) and 3 <= len(steps) < 60
        assert verify(run.checkpoints / "step-00000003.ckpt") is None

        subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)  # space freed
        # Seed and stall timeout at their largest: accepted by the loader, and by what uses them.
        resumed = hvdtrain_cli(*args, "checkpoint.resume=auto", "seed=2147483647",
                               "train.stall_timeout_s=1e6")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert json.loads(run.summary.read_text())["steps"] == 60
        assert [r["step"] for r in read_records(run.metrics)] == list(range(1, 61))


@MOUNTS
def test_a_full_disk_under_tensorboard_is_an_environment_failure_naming_its_file(tmp_path):
    with mounted(tmp_path / "tb", "size=4k") as logdir:
        sink = SinkProcess([("tensorboard", {"logdir": str(logdir)})])
        with pytest.raises(EnvironmentFailure) as caught:
            for step in range(100_000):  # the child reports its failure; a later call raises it
                sink.log({"step": step, "loss": 0.5})
        sink.close()  # raised once; the child has closed its file, so the disk can be unmounted
    assert re.fullmatch(rf"metrics writer: cannot write TensorBoard events '{re.escape(str(logdir))}/"
                        r"events\.out\.tfevents\.[^']+': No space left on device \(ENOSPC\); free "
                        r"space \(or fix the directory\), then resubmit with checkpoint\.resume=auto",
                        str(caught.value)), str(caught.value)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An engine that trained (to restore into) and the checkpoint hvdtrain wrote (to damage)."""
    tmp = tmp_path_factory.mktemp("real")
    result = train(quiet_config(CONFIG, tmp, "train.max_steps=5", *SMALL[:1]))
    return result.engine, sorted((tmp / "run" / "checkpoints").glob("*.ckpt"))[-1]


@pytest.fixture(scope="module")
def real_checkpoint(trained) -> Path:
    return trained[1]


def with_manifest(path: Path, data: bytes) -> Path:
    """Writes ``data`` to ``path`` with a manifest that matches it, as if hvdtrain had written it."""
    path.write_bytes(data)
    manifest_path(path).write_text(json.dumps({"file": path.name, "bytes": len(data), "step": 1,
                                               "sha256": hashlib.sha256(data).hexdigest()}))
    return path


def foreign_files(real: Path, tmp: Path) -> dict[str, bytes]:
    npz = io.BytesIO()
    np.savez(npz, weights=np.ones(3))
    tensors = io.BytesIO()
    torch.save({"weights": torch.ones(3)}, tensors)
    data = real.read_bytes()
    return {"pickle": pickle.dumps({"model": RunsCode(tmp / "ran")}), "npz": npz.getvalue(),
            "tensors": tensors.getvalue(), "random": os.urandom(4096), "head": data[:len(data) // 2],
            "tail": data[len(data) // 3:], "empty": b""}


@pytest.mark.parametrize("kind", ["pickle", "npz", "tensors", "random", "head", "tail", "empty"])
def test_resume_from_a_foreign_file_is_one_line_naming_it_and_runs_nothing(kind, real_checkpoint,
                                                                            tmp_path):
    path = with_manifest(tmp_path / f"{kind}.ckpt", foreign_files(real_checkpoint, tmp_path)[kind])
    line = one_line(hvdtrain_cli("train", str(CONFIG), f"log.dir={tmp_path / 'run'}", *QUIET,
                                 f"checkpoint.resume={path}"), EXIT_USAGE)
    assert line.startswith(f"checkpoint {path} is not an hvdtrain checkpoint or is damaged ("), line
    assert line.endswith("point checkpoint.resume at a step-*.ckpt file that hvdtrain wrote")
    assert not (tmp_path / "ran").exists()
    assert not RunDir(tmp_path / "run").config.exists()  # refused before the run was prepared


def test_resume_from_a_truncated_checkpoint_is_caught_by_its_manifest(real_checkpoint, tmp_path):
    path = tmp_path / real_checkpoint.name
    path.write_bytes(real_checkpoint.read_bytes()[:-100])
    manifest_path(path).write_bytes(manifest_path(real_checkpoint).read_bytes())
    line = one_line(hvdtrain_cli("train", str(CONFIG), f"log.dir={tmp_path / 'run'}", *QUIET,
                                 f"checkpoint.resume={path}"), EXIT_USAGE)
    assert line == f"checkpoint.resume={str(path)!r}: size differs from the manifest (truncated?)"


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=2048) | st.builds(lambda n: b"PK\x03\x04" + bytes(n), st.integers(0, 64)),
       cut=st.floats(0.0, 0.999), payload=st.sampled_from(["bytes", "truncated", "pickle"]))
def test_the_reader_never_runs_code_and_always_gives_one_line(trained, tmp_path, data, cut, payload):
    engine, real_checkpoint = trained
    real = real_checkpoint.read_bytes()
    content = {"bytes": data, "truncated": real[:int(len(real) * cut)],
               "pickle": pickle.dumps([RunsCode(tmp_path / "ran"), data], protocol=2)}[payload]
    path = with_manifest(tmp_path / "step-00000001.ckpt", content)
    cfg = quiet_config(CONFIG, tmp_path, f"checkpoint.resume={path}", *SMALL[:1])
    with pytest.raises(HvdtrainError) as caught:
        restore(engine, find_checkpoint(cfg, RunDir(cfg.run_dir)), cfg)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    assert not (tmp_path / "ran").exists()
