"""A model bigger than a rank's memory, shown on the local Slurm cluster, which confines every job to
the memory it was given (``task/cgroup`` with ``ConstrainRAMSpace``, ``scripts/slurm_local.sh``).

The built-in GPT at 8 blocks of width 512 with Adam needs more than the ``--mem-per-cpu`` given here
in each of two data-parallel replicas: the kernel's out-of-memory killer ends the job, Slurm says so in
the job's log and state (``OUT_OF_MEMORY``). The same model split into 2 pipeline stages holds half
of the parameters, gradients and optimizer state on each rank and trains to the end in the same
limit, and so does the model sharded over the two ranks at ZeRO's stage 3 (``shard.stage=3``: each
rank holds half of the parameters, gradients and optimizer state, and one unit's gathered
parameters at a time). Each rank's peak memory is in the runs' summaries and the test compares
them."""

from __future__ import annotations

import json

import pytest

from tests.slurm.test_slurm import job_field, job_log, submit, wait_state
from tests.text_data import LM_CONFIGS, docs_corpus

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY"}
BIG = ("model.options.d_model=512", "model.options.layers=8", "data.batch_size=8",
       "train.max_steps=4", "checkpoint.enabled=false", "checkpoint.every_steps=0",
       "log.console=false")
LIMIT = ("--mem-per-cpu", "950M")  # per rank; a replica peaks near 1.2 GB here, a stage near 0.7


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return docs_corpus(tmp_path_factory.mktemp("docs-text"))


def run_job(tmp_path, corpus, *overrides: str) -> tuple[str, str]:
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, f"data.options.root={corpus}", *BIG, *overrides, options=LIMIT,
                    config=LM_CONFIGS["torch"])
    return job_id, wait_state(job_id, ENDED, timeout=420)


def test_a_replica_over_the_limit_is_killed_and_two_stages_or_shards_train_in_it(cluster, corpus,
                                                                                 tmp_path):
    job_id, state = run_job(tmp_path / "replicas", corpus, "pipeline.stages=1")
    log = job_log(tmp_path / "replicas" / "run", job_id)
    assert state == "OUT_OF_MEMORY", log
    assert job_field(job_id, "Reason") == "OutOfMemory"
    assert "oom-kill" in log and "out-of-memory handler" in log, log  # Slurm's own words
    job_id, state = run_job(tmp_path / "stages", corpus, "pipeline.stages=2",
                            "pipeline.microbatches=4")
    run_dir = tmp_path / "stages" / "run"
    assert state == "COMPLETED", job_log(run_dir, job_id)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    # each stage's rank peaks well under one full replica (which the first job could not hold)
    assert max(summary["peak_rss_mb"]) < 950, summary["peak_rss_mb"]
    job_id, state = run_job(tmp_path / "shards", corpus, "shard.stage=3")
    run_dir = tmp_path / "shards" / "run"
    assert state == "COMPLETED", job_log(run_dir, job_id)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4 and summary["shard_stage"] == 3
    assert max(summary["peak_rss_mb"]) < 950, summary["peak_rss_mb"]
