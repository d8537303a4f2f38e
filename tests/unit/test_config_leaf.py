"""The config is a leaf (issue 56): importing and using :mod:`hvdtrain.config` imports no feature
package and no framework. The name lists and checks it needs live in hvdtrain.choices and
hvdtrain/strategies/ (comm.py, schedules.py), and the feature packages read them from there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FEATURES = ("hvdtrain.compression", "hvdtrain.pipeline", "hvdtrain.device", "hvdtrain.precision",
            "hvdtrain.ps", "torch", "tensorflow")
"""Packages (and their submodules) that importing the config must not import."""

PROBE = """
import json, sys
import hvdtrain.config as config
{use}
print(json.dumps(sorted(sys.modules)))
"""


def _modules_after(use: str = "") -> list[str]:
    """The modules a fresh interpreter holds after importing the config and running ``use``."""
    out = subprocess.run([sys.executable, "-c", PROBE.format(use=use)], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.splitlines()[-1])


def _features(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == f or m.startswith(f"{f}.") for f in FEATURES)]


def test_importing_the_config_imports_no_feature_or_framework():
    modules = _modules_after()
    assert "hvdtrain.config" in modules
    assert _features(modules) == []


def test_validating_a_config_with_every_section_set_imports_no_feature():
    # Validation runs every section's checks (comm's, the pipeline schedules', the table's).
    use = ("config.load_config(None, ['pipeline.stages=2', 'pipeline.schedule=gpipe', "
           "'comm.compression=topk', 'comm.ratio=0.1', 'train.device=cpu', "
           "'optim.name=adam'], environ={})\n"
           "config.load_config(None, ['train.precision=bf16'], environ={})\n"
           "try:\n"
           "    config.load_config(None, ['pipeline.stages=2', 'pipeline.schedule=nope'], "
           "environ={})\n"
           "except config.ConfigError:\n"
           "    pass")
    assert _features(_modules_after(use)) == []


def test_the_features_read_their_names_from_the_one_place():
    from hvdtrain import choices, compression, device, pipeline
    from hvdtrain.strategies import comm, schedules

    assert compression.METHODS is comm.METHODS
    assert tuple(compression.PLANS) == tuple(sorted(comm.METHODS))
    assert device.DEVICES is choices.DEVICES
    assert pipeline.SCHEDULES is schedules.SCHEDULES
    assert tuple(schedules.SCHEDULES) == schedules.SCHEDULE_NAMES
