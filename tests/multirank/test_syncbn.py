"""Synchronized batch norm at -np 2 (Gloo, CPU): each rank's output and running statistics equal
those of one plain batch-norm layer on the global batch, in both frameworks."""

import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import horovodrun
from tests.multirank.syncbn_worker import batch

WORKER = str(Path(__file__).with_name("syncbn_worker.py"))


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_sync_batchnorm_equals_one_process_on_the_global_batch(tmp_path, framework):
    proc = horovodrun(2, "gloo", [sys.executable, WORKER, str(tmp_path), framework], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        with np.load(tmp_path / f"rank{rank}.npz") as npz:
            got = dict(npz)
        assert int(got["size"]) == 2
        for key in ("out", "mean", "var"):
            np.testing.assert_allclose(got[key], got[f"expected_{key}"], rtol=1e-5, atol=1e-5,
                                       err_msg=f"rank {rank} {key}")
        # Not trivially equal: the rank's own half alone would give other running means.
        half_mean = batch()[rank::2].mean(axis=(0, 2, 3))
        assert not np.allclose(0.5 * half_mean, got["mean"], rtol=1e-3, atol=1e-3)
