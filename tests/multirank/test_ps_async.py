"""Parameter servers with ``ps.consistency=ssp`` and ``asp`` (the servers run the optimizer) under
``horovodrun --mpi``: one launch of 2 PyTorch workers + 1 server (-np 3), three short runs in it:

- ``ssp`` (bound 1, SGD with momentum, worker 1 slowed by 5 ms a step), 1 epoch;
- ``asp`` (Adam, the same straggler), 2 epochs, checkpointing at the end;
- ``resumed``: ``asp`` continued from that checkpoint for a third epoch.

Resuming on another number of servers is shown bit-exact without a framework in
tests/unit/test_ps_async_server.py. Asynchrony makes the parameters depend on timing, so the checks
are on progress (accuracy far above chance), the staleness figures and the bound that holds for
``ssp``, and the servers' state in and out of the checkpoints; never on timings.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import read_jsonl
from tests.multirank.conftest import Launch, launch_worker

RUN = ("comm.topology=ps,ps.servers=1,log.every_steps=5,train.slow_rank=1,train.slow_ms=5,"
       "optim.warmup_steps=0")
SSP = f"{RUN},ps.consistency=ssp,ps.staleness=1,train.epochs=1"
ASP = f"{RUN},ps.consistency=asp,optim.name=adam,optim.lr=0.002"
STEPS = 23
"""Steps of an epoch: 1,437 digits over 2 workers x 32."""
WORKERS, BOUND = 2, 1


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Launch:
    out = tmp_path_factory.mktemp("ps-async")
    saved = out / "asp" / "checkpoints" / f"step-{2 * STEPS:08d}.ckpt"
    return launch_worker(WORKERS + 1, "mpi", "torch", out, [
        f"ssp:{SSP}", f"asp:{ASP},train.epochs=2",
        f"resumed:{ASP},train.epochs=3,checkpoint.resume={saved}"])


def server_state(launch: Launch, run: str, step: int) -> dict[str, torch.Tensor]:
    saved = torch.load(launch.out / run / "checkpoints" / f"step-{step:08d}.ckpt",
                       weights_only=True)
    return saved["compression"]


def test_ssp_and_asp_train_and_report_their_staleness(launch):
    for run, epochs in (("ssp", 1), ("asp", 2)):
        summary = launch.summary(run)
        assert summary["steps"] == epochs * STEPS and summary["world_size"] == WORKERS
        assert summary["final"]["eval_accuracy"] > 0.5, run  # chance is 0.1
        assert summary["pushes_total"] == WORKERS * epochs * STEPS, run
        records = [r for r in read_jsonl(launch.out / run / "metrics.jsonl") if "loss" in r]
        assert records[-1]["loss"] < records[0]["loss"], run
        for record in records:
            assert 0 <= record["staleness_mean"] <= record["staleness_max"], (run, record)
        assert summary["staleness_max"] == max(r["staleness_max"] for r in records)
    # The bound that holds under ssp, in server updates: (N - 1)(2s + 1).
    bound = (WORKERS - 1) * (2 * BOUND + 1)
    assert launch.summary("ssp")["staleness_max"] <= bound


def test_checkpoints_carry_the_servers_state_and_resume_it(launch):
    saved = server_state(launch, "asp", 2 * STEPS)
    assert int(saved["ps_steps"]) == WORKERS * 2 * STEPS  # Adam's steps: one per push
    assert set(saved) == {"ps_steps", "ps_exp_avg", "ps_exp_avg_sq"}
    assert saved["ps_exp_avg_sq"].abs().sum() > 0
    # The resumed servers went on counting from the checkpoint: their state was restored.
    resumed = server_state(launch, "resumed", 3 * STEPS)
    assert int(resumed["ps_steps"]) == WORKERS * 3 * STEPS
    summary = launch.summary("resumed")
    assert summary["steps"] == 3 * STEPS and summary["pushes_total"] == WORKERS * STEPS
    first = next(r for r in read_jsonl(launch.out / "resumed" / "metrics.jsonl") if "loss" in r)
    fresh = next(r for r in read_jsonl(launch.out / "asp" / "metrics.jsonl") if "loss" in r)
    assert first["loss"] < fresh["loss"]  # it went on from the trained model
    assert summary["final"]["eval_accuracy"] > 0.5
