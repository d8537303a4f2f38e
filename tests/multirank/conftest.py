"""Two-rank launches shared by the multirank tests: one horovodrun per framework and controller."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import CONFIG, TF_CONFIG, horovodrun

WORKER = str(Path(__file__).with_name("worker.py"))
PYTHON = sys.executable
CONFIGS = {"torch": CONFIG, "tensorflow": TF_CONFIG}
# The equivalence runs: 2 ranks x 16 samples against 1 rank x 32, both accumulating 2 micro-batches.
# Digits has 1,437 training samples, so each epoch's last step holds 29 samples: the ranks get
# unequal shares and the second micro-batch is empty, which the loss weighting must absorb.
EQUIV = ("data.batch_size={b},train.backward_passes_per_step=2,optim.lr={lr},train.epochs=5,"
         "optim.warmup_steps=0")


@dataclass
class Launch:
    """The output folder of one worker launch and how it was made."""

    framework: str
    controller: str
    out: Path

    def summary(self, run: str) -> dict:
        """Rank 0's ``summary.json`` of one run."""
        return json.loads((self.out / run / "summary.json").read_text())

    def rank(self, run: str, rank: int) -> tuple[dict[str, np.ndarray], dict]:
        """One rank's parameters and its own record (local eval sums, summary)."""
        with np.load(self.out / run / f"rank{rank}.npz") as npz:
            params = dict(npz)
        return params, json.loads((self.out / run / f"rank{rank}.json").read_text())


def launch_worker(np_: int, controller: str, framework: str, out: Path, runs: list[str]) -> Launch:
    """Starts the worker under horovodrun and fails with its output if it fails."""
    proc = horovodrun(np_, controller, [PYTHON, WORKER, str(out), str(CONFIGS[framework]), *runs],
                      timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Launch(framework, controller, out)


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory) -> Callable[[str, str], Launch]:
    """``two_ranks(framework, controller)``: baseline, fp16 and the equivalence run, back to back in
    one launch at 2 ranks; launched on first use and shared by every test that asks again."""
    cache: dict[tuple[str, str], Launch] = {}

    def get(framework: str, controller: str) -> Launch:
        if (framework, controller) not in cache:
            out = tmp_path_factory.mktemp(f"np2-{framework}-{controller}")
            runs = ["base:", "fp16:comm.compression=fp16", "equiv:" + EQUIV.format(b=16, lr=0.05)]
            cache[framework, controller] = launch_worker(2, controller, framework, out, runs)
        return cache[framework, controller]

    return get


@pytest.fixture(scope="session")
def one_rank_equiv(tmp_path_factory) -> Callable[[str], Launch]:
    """``one_rank_equiv(framework)``: the one-rank side of the equivalence (batch 32, lr 0.1)."""
    cache: dict[str, Launch] = {}

    def get(framework: str) -> Launch:
        if framework not in cache:
            out = tmp_path_factory.mktemp(f"np1-{framework}")
            cache[framework] = launch_worker(1, "gloo", framework, out,
                                             ["one:" + EQUIV.format(b=32, lr=0.1)])
        return cache[framework]

    return get
