"""What setup.cfg cannot say: the packages, because one of them lives outside ``hvdtrain/``.

The top-level ``slurm/`` directory holds the sbatch templates and the elastic job's host discovery
script, where a user reads and copies them. The wheel ships that one copy as ``hvdtrain/_slurm/``
(``package_dir`` maps the data package ``hvdtrain._slurm`` to ``slurm/``), and ``hvdtrain.slurm``
reads it there through :mod:`importlib.resources`; from a checkout (an editable install, or
PYTHONPATH) it reads ``slurm/`` itself. setup.cfg's ``packages = find:`` cannot add a package
that is not under ``hvdtrain/`` to the ones it finds, hence this list. The discovery script keeps
its executable bit in the wheel (build_py copies modes), as horovodrun runs it. The planner's
published profiles and cluster file (``hvdtrain/plan/published/``) ship as data of
``hvdtrain.plan``.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["hvdtrain*"]), "hvdtrain._slurm"],
      package_dir={"hvdtrain._slurm": "slurm"},
      package_data={"hvdtrain._slurm": ["*.sbatch", "*.sh"],
                    "hvdtrain.plan": ["published/*.json", "published/*.yaml"]})
