"""TensorFlow pipeline stages with every optimizer setting the docs list train as one process does:
the TensorFlow half of :mod:`tests.multirank.test_pipeline_optimizers`, the same runs (Adam; AdamW
with decoupled decay, warm-up and cosine; Adam with L2 decay; SGD with momentum and decay) on the
digits MLP with one hidden layer of 32, 2 stages at ``horovodrun -np 2`` (Gloo) against one
process: every step's loss within 1e-5 relative, the final parameters within 1e-5.

No defect was found here (seen 2026-12-06: losses within 1.1e-7 relative, parameters within
2e-7): Keras optimizers make their state when built, without a step, on the ring and on a stage
alike; AdamW decays each variable by itself and L2 decay is added per gradient, so nothing spans
stages. The whole matrix is `long` (`make test-long`): two TensorFlow launches cost about a
minute and a half on 2 busy cores, and `make test` trains TensorFlow's stages with Adam in
`tests/multirank/test_pipeline_checkpoint.py`.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.multirank.conftest import Launch, launch_worker
from tests.multirank.test_pipeline_optimizers import ATOL, COMMON, OPTIMIZERS, RTOL, STAGES, step_losses
from tests.multirank.test_pipeline_tf import stage_params

TF_COMMON = COMMON + ",model.options.hidden=[32]"
pytestmark = [pytest.mark.long, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[int, Launch]:
    """Every optimizer's run at one process without stages and at 2 stages (-np 2), each size
    one launch."""
    return {np_: launch_worker(np_, "gloo", "tensorflow",
                               tmp_path_factory.mktemp(f"tf-optim-np{np_}"),
                               [f"{name}:{TF_COMMON},{extra}{extra_stages}"
                                for name, extra in OPTIMIZERS.items()])
            for np_, extra_stages in ((1, ""), (2, "," + STAGES))}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_two_stages_equal_one_process_with_this_optimizer(launches, name):
    one, staged = launches[1], launches[2]
    want, got = step_losses(one.out, name), step_losses(staged.out, name)
    assert len(want) == 6
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=0, err_msg=f"{name}: step losses")
    assert want[-1] < want[0]  # it trains: the comparison is not of two idle runs
    params, _ = one.rank(name, 0)
    expected = [params[k] for k in sorted(params, key=lambda n: int(n.split(".")[0]))]
    got_params = stage_params(staged, name, [0, 1])
    assert [p.shape for p in got_params] == [p.shape for p in expected]
    for mine, theirs in zip(got_params, expected, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=ATOL, err_msg=name)
    assert staged.summary(name)["pipeline"] == "2 stages x 1 copies"
