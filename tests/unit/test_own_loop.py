"""The own-loop APIs' framework-free check (:mod:`hvdtrain.own_loop`): ranks that reach the API's
metric allreduce at different steps get one line naming the step and the call."""

from __future__ import annotations

import pytest

from hvdtrain.errors import HvdtrainError
from hvdtrain.own_loop import check_same_step


def test_ranks_at_different_steps_are_one_line():
    check_same_step(24.0, 12, 2, "log")  # both ranks at step 12
    with pytest.raises(HvdtrainError, match=r"^trainer.log\(\) at step 12 on this rank, but the "
                                            r"ranks' steps add up to 25: every rank must run"):
        check_same_step(25.0, 12, 2, "log")
