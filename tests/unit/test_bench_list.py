"""`make bench`'s list (benchmarks/all.sh) and docs/testing.md's table of benchmark drivers name
every driver of ``benchmarks/``: a new benchmark is either run by `make bench` or listed with why
it is not, and described in the table."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import ROOT

# Not drivers: what the drivers' jobs run, their machinery, and the index generator.
HELPERS = {"__init__.py", "harness.py", "index.py", "workload.py", "allreduce_records.py"}


def drivers() -> set[str]:
    """The driver scripts of benchmarks/: every module but the workers and the machinery."""
    return {p.name for p in (ROOT / "benchmarks").glob("*.py")
            if p.name not in HELPERS and not p.name.endswith("_worker.py")
            and not p.name.startswith("handwritten_")}


def listed() -> set[str]:
    """The scripts ``benchmarks/all.sh --list`` names, in `make bench` or by hand."""
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "all.sh"), "--list"],
                         capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"([\w]+\.py)", out))


def test_every_driver_is_in_make_bench_or_listed_with_why_not():
    assert drivers() - listed() == set()
    assert {s for s in listed() if s != "soak_checkpoint.py"} <= drivers()


def test_every_driver_has_a_row_in_the_testing_page():
    page = (ROOT / "docs" / "testing.md").read_text()
    assert {d for d in drivers() if f"| `{d}` |" not in page} == set()
