"""hvdtrain installed from a wheel into a fresh virtual environment, away from the checkout: every
file it reads at run time (the sbatch templates, the host discovery script, the dashboards' writer
process) must ship inside the package.

The environment gets the wheels of hvdtrain (built here) and of Horovod (the one scripts/setup.sh
cached and installed into .venv), and reuses the other packages of .venv through a ``.pth`` line
that puts .venv's site-packages after its own, so that its own hvdtrain and Horovod are the ones
imported. Every command runs from a directory outside the repository, with no PYTHONPATH.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

from hvdtrain.slurm import JobOptions, render
from tests.conftest import CONFIG, ROOT

# What a wheel is built from: the working tree less what setuptools and the runs leave behind.
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "runs", "build", "dist", "*.egg-info", "__pycache__",
                                    ".pytest_cache", "wandb", "hvdtrain-bench-*")


@dataclass(frozen=True)
class Venv:
    """The fresh environment and a working directory outside the repository."""

    prefix: Path
    site: Path
    workdir: Path
    config: Path

    @property
    def bin(self) -> Path:
        """The environment's ``bin`` directory."""
        return self.prefix / "bin"

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Runs ``argv`` (its first word from the environment's ``bin``) in the working directory."""
        env = {key: value for key, value in os.environ.items()
               if key != "PYTHONPATH" and not key.startswith("HVDTRAIN_")}
        env.update(WANDB_MODE="offline", WANDB_SILENT="true", OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        return subprocess.run([str(self.bin / argv[0]), *argv[1:]], cwd=self.workdir, env=env,
                              capture_output=True, text=True, timeout=timeout)


def cached_horovod_wheel() -> Path:
    """The Horovod wheel that scripts/setup.sh built and installed into this interpreter's
    environment: its stamp in the environment names the cache directory that holds the wheel."""
    stamps = sorted(Path(sys.prefix).glob(".hvdtrain-horovod-*"))
    assert len(stamps) == 1, f"no single Horovod stamp in {sys.prefix} ({stamps}): run `make setup`"
    cache = Path(os.environ.get("HVDTRAIN_CACHE", Path.home() / ".cache" / "hvdtrain"))
    wheels = sorted((cache / stamps[0].name.removeprefix(".hvdtrain-")).glob("horovod-*.whl"))
    assert len(wheels) == 1, f"no cached Horovod wheel for {stamps[0].name} in {cache}: run `make setup`"
    return wheels[0]


def pip(*args: str) -> None:
    """This interpreter's pip, offline, failing with its output."""
    proc = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args, "--no-index",
                           "--no-deps"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A fresh environment with hvdtrain and Horovod installed from wheels."""
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    pip("wheel", "--no-build-isolation", "-q", "-w", str(tmp / "dist"), str(source))
    prefix = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix)], check=True, timeout=120)
    python = prefix / "bin" / "python"
    # Installed before the .pth line exists, so that pip sees none of .venv's packages as present.
    wheels = [*map(str, (tmp / "dist").glob("hvdtrain-*.whl")), str(cached_horovod_wheel())]
    pip("--python", str(python), "install", "-q", "--no-compile", *wheels)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([str(python), "-c", purelib], capture_output=True, text=True,
                               check=True).stdout.strip())
    # A plain path line: .venv's own .pth files (the editable hvdtrain's among them) are not read.
    shared = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "zz-hvdtrain-test-shared.pth").write_text("".join(f"{path}\n" for path in shared))
    workdir = tmp / "work"
    workdir.mkdir()
    config = workdir / CONFIG.name
    shutil.copy(CONFIG, config)
    return Venv(prefix=prefix, site=site, workdir=workdir, config=config)


def test_the_environment_imports_its_own_hvdtrain_and_horovod(venv):
    where = "import hvdtrain, horovod; print(hvdtrain.__file__); print(horovod.__file__)"
    proc = venv.run("python", "-c", where)
    assert proc.returncode == 0, proc.stderr
    paths = [Path(line) for line in proc.stdout.splitlines()]
    assert len(paths) == 2 and all(path.is_relative_to(venv.site) for path in paths), paths


def test_slurm_render_reads_the_templates_from_the_package(venv, monkeypatch):
    proc = venv.run("hvdtrain", "slurm", "render", str(venv.config), "--tasks-per-node", "2")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.startswith("#!/bin/bash\n# Rendered by `hvdtrain slurm render`")
    assert f"BIN={venv.bin}\n" in text and str(ROOT) not in text
    # the same script as the checkout renders, bar the environment it runs from
    monkeypatch.chdir(venv.workdir)
    expected = render(venv.config, (), JobOptions(tasks_per_node=2))
    assert text == expected.replace(f"BIN={Path(sys.executable).parent}\n", f"BIN={venv.bin}\n")


def test_elastic_render_points_at_the_installed_discovery_script(venv):
    proc = venv.run("hvdtrain", "slurm", "render", str(venv.config), "--elastic", "--nodes", "2")
    assert proc.returncode == 0, proc.stderr
    found = re.search(r"^DISCOVERY=(\S+)$", proc.stdout, re.M)
    assert found, proc.stdout
    script = Path(found.group(1))
    assert script == venv.site / "hvdtrain" / "_slurm" / "discover_hosts_slurm.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", "-c", proc.stdout], check=True)


def test_the_wheel_ships_the_top_level_slurm_directory_as_it_is(venv):
    shipped = venv.site / "hvdtrain" / "_slurm"
    files = sorted(path.name for path in (ROOT / "slurm").iterdir())
    assert sorted(path.name for path in shipped.iterdir()) == files
    for name in files:
        assert (shipped / name).read_bytes() == (ROOT / "slurm" / name).read_bytes(), name
    # slurm/ is data inside hvdtrain, not a top-level package of its own
    assert not (venv.site / "slurm").exists()


def test_one_rank_trains_with_tensorboard_and_wandb(venv):
    run_dir = venv.workdir / "run"
    proc = venv.run("hvdtrain", "train", str(venv.config), "train.epochs=1", f"log.dir={run_dir}",
                    "log.tensorboard=true", "log.wandb=offline", "log.console=false")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"outputs in {run_dir}" in proc.stdout
    assert (run_dir / "summary.json").exists()
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 200, events
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("run-*.wandb")), offline
