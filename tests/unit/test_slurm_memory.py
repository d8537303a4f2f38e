"""``hvdtrain slurm render --mem`` and ``--overcommit``: the lines they put in the job script (the
local Slurm cluster runs such a script in tests/slurm/test_memory_limit.py)."""

import re
import subprocess

import pytest

from hvdtrain.errors import HvdtrainError
from hvdtrain.slurm import JobOptions, render
from tests.conftest import CONFIG


def overrides(tmp_path):
    return [f"log.dir={tmp_path / 'run'}", "log.wandb=disabled", "log.console=false"]


def sbatch_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#SBATCH ")]


def test_overcommit_asks_for_every_rank_as_ntasks_and_mem_for_the_node(tmp_path):
    """4 ranks on one node of fewer CPUs: ``--ntasks=4`` with ``--overcommit`` in place of
    ``--ntasks-per-node=4``, ``--mem`` as given; horovodrun still starts 4 ranks on the node."""
    options = JobOptions(nodes=1, tasks_per_node=4, overcommit=True, mem="4280M")
    text = render(CONFIG, overrides(tmp_path), options)
    lines = sbatch_lines(text)
    assert "#SBATCH --ntasks=4" in lines and "#SBATCH --overcommit" in lines, lines
    assert "#SBATCH --mem=4280M" in lines, lines
    assert not any(line.startswith(("#SBATCH --ntasks-per-node", "#SBATCH --mem-per-cpu"))
                   for line in lines), lines
    assert re.search(r'horovodrun" -np 4 -H "\$HOSTS"', text), text
    hosts = text[text.index('HOSTS=""'):text.index("descendants()")]
    out = subprocess.run(["bash", "-c", hosts + 'echo "$HOSTS"'], capture_output=True, text=True,
                         env={"PATH": f"{tmp_path}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "a"})
    assert out.stdout.strip() == "a:4", out.stderr  # Slurm's own scontrol expands the list
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_without_the_options_the_script_asks_per_node(tmp_path):
    text = render(CONFIG, overrides(tmp_path), JobOptions(nodes=2, tasks_per_node=3))
    lines = sbatch_lines(text)
    assert "#SBATCH --ntasks-per-node=3" in lines, lines
    assert not any(line.startswith(("#SBATCH --ntasks=", "#SBATCH --overcommit", "#SBATCH --mem"))
                   for line in lines), lines
    assert re.search(r'horovodrun" -np 6 ', text), text


def test_elastic_script_takes_them_too(tmp_path):
    text = render(CONFIG, overrides(tmp_path), JobOptions(nodes=2, tasks_per_node=2, elastic=True,
                                                          overcommit=True, mem="2G"))
    lines = sbatch_lines(text)
    assert {"#SBATCH --ntasks=4", "#SBATCH --overcommit", "#SBATCH --mem=2G"} <= set(lines), lines
    assert "export HVDTRAIN_SLOTS_PER_HOST=2" in text


@pytest.mark.parametrize("options, message", [
    (JobOptions(mem="4 G"), "--mem='4 G': expected a size such as 4G or 1500M"),
    (JobOptions(mem="4G", mem_per_cpu="1G"),
     "--mem and --mem-per-cpu: Slurm takes one of them, not both"),
    (JobOptions(overcommit=True, launcher="srun"),
     "--overcommit: renders for --launcher horovodrun only"),
])
def test_bad_memory_options_are_user_errors(tmp_path, options, message):
    with pytest.raises(HvdtrainError, match=re.escape(message)):
        render(CONFIG, overrides(tmp_path), options)
