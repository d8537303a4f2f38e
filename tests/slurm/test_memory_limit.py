"""A model bigger than a rank's memory, shown on the local Slurm cluster, which confines every job to
the memory it was given (``task/cgroup`` with ``ConstrainRAMSpace``, ``scripts/slurm_local.sh``).

The built-in GPT at 8 blocks of width 512 with Adam needs more than the ``--mem-per-cpu`` given here
in each of two data-parallel replicas: the kernel's out-of-memory killer ends the job, Slurm says so in
the job's log and state (``OUT_OF_MEMORY``). The same model split into 2 pipeline stages holds half
of the parameters, gradients and optimizer state on each rank and trains to the end in the same
limit, and so does the model sharded over the two ranks at ZeRO's stage 3 (``shard.stage=3``: each
rank holds half of the parameters, gradients and optimizer state, and one unit's gathered
parameters at a time). Each rank's peak memory is in the runs' summaries and the test compares
them.

Both together: a GPT of 101 M parameters (8 blocks of width 1024) that neither 2 pipeline stages
(each rank half of the model with Adam) nor stage 3 over 2 ranks fits in 1070 MiB a rank, trained
to the end by 2 pipeline stages x 2 sharded copies at stage 3 (each rank a quarter) in the same
1070 MiB a rank (docs/sharding.md, "Sharding or pipeline stages")."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from hvdtrain.data.text import make_text
from tests.conftest import ROOT, hvdtrain_cli
from tests.slurm.test_slurm import job_field, job_log, submit, wait_state
from tests.text_data import LM_CONFIGS, docs_corpus

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY"}
BIG = ("model.options.d_model=512", "model.options.layers=8", "data.batch_size=8",
       "train.max_steps=2", "checkpoint.enabled=false", "checkpoint.every_steps=0",
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
    assert summary["world_size"] == 2 and summary["steps"] == 2
    # each stage's rank peaks well under one full replica (which the first job could not hold)
    assert max(summary["peak_rss_mb"]) < 950, summary["peak_rss_mb"]
    job_id, state = run_job(tmp_path / "shards", corpus, "shard.stage=3")
    run_dir = tmp_path / "shards" / "run"
    assert state == "COMPLETED", job_log(run_dir, job_id)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2 and summary["shard_stage"] == 3
    assert max(summary["peak_rss_mb"]) < 950, summary["peak_rss_mb"]


# --- both together: 2 pipeline stages x 2 sharded copies -------------------------------------

HUGE = ("model.options.d_model=1024", "model.options.layers=8", "data.batch_size=2",
        "data.options.seq_len=32", "data.eval_batch_size=64", "train.max_steps=2",
        "checkpoint.enabled=false", "checkpoint.every_steps=0", "log.console=false",
        "log.tensorboard=false")
STAGES = ("pipeline.stages=2", "pipeline.microbatches=2")
SHARDS = ("shard.stage=3", "shard.unit_kib=4096")  # a block's linear layers gathered one by one
PER_RANK_MB = 1070  # MiB; peaks a rank: 2 stages ~1,220, stage 3 on 2 ranks more, 2 x 2 ~930


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """60 KB of the docs with a validation split of 9 windows of 32 bytes: one evaluation batch a
    copy, so that evaluation costs little next to the 2 training steps."""
    root = tmp_path_factory.mktemp("small-text")
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    source = root / "source.md"
    source.write_bytes(b"".join(f.read_bytes() + b"\n" for f in files)[:60_000])
    make_text([source], root / "corpus", val_fraction=0.005)
    return root / "corpus"


def submit_four_ranks(run_dir: Path, *overrides: str) -> str:
    """hvdtrain's job script for 4 ranks on the one node, asking for PER_RANK_MB a rank.

    A real cluster gives 4 tasks 4 CPUs and ``--mem-per-cpu`` then confines the job to 4 x that.
    This node has 2 cores, so the script asks for the 4 tasks with ``--overcommit`` (sbatch refuses
    ``--ntasks-per-node=4`` on 2 CPUs, with or without it; hvdtrain's ``--overcommit`` asks for
    ``--ntasks=4`` instead), which allocates one CPU, and for the same 4 x PER_RANK_MB with
    ``--mem``: horovodrun starts every rank in the batch step, whose cgroup holds the job's memory
    either way."""
    proc = hvdtrain_cli("slurm", "render", str(LM_CONFIGS["torch"]), f"log.dir={run_dir}",
                        "log.wandb=disabled", *overrides, "--nodes", "1", "--tasks-per-node", "4",
                        "--time", "20:00", "--overcommit", "--mem", f"{4 * PER_RANK_MB}M")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert ("#SBATCH --ntasks=4\n#SBATCH --overcommit\n" in text
            and f"#SBATCH --mem={4 * PER_RANK_MB}M\n" in text), text
    assert re.search(r'horovodrun" -np 4 ', text), text
    run_dir.mkdir(parents=True)
    script = run_dir / "job.sbatch"
    script.write_text(text)
    sbatch = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                            cwd=ROOT)
    assert sbatch.returncode == 0, sbatch.stderr
    return sbatch.stdout.strip().split(";")[0]


def run_two_ranks(run_dir: Path, corpus: Path, *overrides: str) -> tuple[str, str]:
    job_id = submit(run_dir, f"data.options.root={corpus}", *HUGE, *overrides,
                    options=("--mem-per-cpu", f"{PER_RANK_MB}M"), config=LM_CONFIGS["torch"])
    return job_id, wait_state(job_id, ENDED, timeout=420)


@pytest.mark.long  # three jobs of a 101 M-parameter model: minutes on 2 cores
@pytest.mark.timeout(1800)
def test_stages_times_shards_train_a_model_neither_fits_alone(cluster, small_corpus, tmp_path):
    """2 pipeline stages on 2 ranks, and stage 3 on 2 ranks, are killed OUT_OF_MEMORY; 2 stages x
    2 copies at stage 3 on 4 ranks train to the end, each rank under the same limit."""
    for name, overrides in (("stages", STAGES), ("shards", SHARDS)):
        run_dir = tmp_path / name / "run"
        job_id, state = run_two_ranks(run_dir, small_corpus, *overrides)
        assert state == "OUT_OF_MEMORY", (name, job_log(run_dir, job_id))
        assert job_field(job_id, "MinMemoryCPU") == f"{PER_RANK_MB}M"  # x 2 CPUs: 2 ranks
        assert "oom-kill" in job_log(run_dir, job_id)
    run_dir = tmp_path / "both" / "run"
    job_id = submit_four_ranks(run_dir, f"data.options.root={small_corpus}", *HUGE,
                               *STAGES, *SHARDS)
    state = wait_state(job_id, ENDED, timeout=600)
    assert state == "COMPLETED", job_log(run_dir, job_id)
    assert job_field(job_id, "MinMemoryNode") == f"{4 * PER_RANK_MB}M"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["steps"] == 2 and summary["shard_stage"] == 3
    assert summary["pipeline"] == "2 stages x 2 copies", summary["pipeline"]
    peaks = summary["peak_rss_mb"]
    assert len(peaks) == 4 and max(peaks) < PER_RANK_MB, peaks
