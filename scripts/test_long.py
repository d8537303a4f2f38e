"""``make test-long``: the tests marked ``long``, and, when every invocation is green, their record
in docs/testing.md (the block between ``<!-- test-long:begin -->`` and ``<!-- test-long:end -->``).

Each pytest invocation writes a JUnit XML report, from which its counts are read (passed, failed,
errors, skipped). pytest's exit code 5 (no test selected in a folder) counts as green. The record
names the date (UTC), the commit and whether the tree had uncommitted changes to tracked files,
each invocation's counts and the wall time; a failed run leaves the previous record as it was and
exits 1. Run from the repository root: ``.venv/bin/python scripts/test_long.py``.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "testing.md"
BEGIN, END = "<!-- test-long:begin -->", "<!-- test-long:end -->"
INVOCATIONS = [
    ["-m", "long", "--durations=15", "tests/multirank"],
    ["-m", "long", "tests/slurm"],
    ["-m", "long", "tests/tensorflow"],
]
"""The pytest arguments of each invocation: tests/slurm on the one-node cluster that ``make
test-long`` starts; the TensorFlow folder in a process of its own (as in ``make test``: Horovod
for both frameworks in one process crashes it at exit)."""


@dataclass
class Result:
    """One invocation: its arguments, exit code and counts."""

    args: list[str]
    code: int
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0

    @property
    def green(self) -> bool:
        return self.code == 5 or (self.code == 0 and not self.failed and not self.errors)

    def line(self) -> str:
        """The record's row for this invocation."""
        return (f"| `pytest {' '.join(self.args)}` | {self.passed} | {self.failed} | {self.errors} "
                f"| {self.skipped} | {self.seconds / 60:.1f} |")


def counts(report: Path) -> tuple[int, int, int, int]:
    """Passed, failed, errors and skipped of a JUnit XML report (all zero if pytest wrote none)."""
    if not report.exists():
        return 0, 0, 0, 0
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) for s in suites)
    errors = sum(int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return total - failed - errors - skipped, failed, errors, skipped


def run(args: list[str], folder: Path, index: int) -> Result:
    report = folder / f"junit-{index}.xml"
    start = time.monotonic()
    code = subprocess.call([sys.executable, "-m", "pytest", *args, f"--junitxml={report}"],
                           cwd=ROOT)
    passed, failed, errors, skipped = counts(report)
    return Result(args, code, passed, failed, errors, skipped, time.monotonic() - start)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def tree_state() -> str:
    """The commit the run starts from, and whether tracked files differ from it."""
    commit = git("rev-parse", "--short=12", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"`{commit}`" + (" with uncommitted changes to tracked files in the working tree"
                            if dirty else ", clean working tree")


def record(results: list[Result], started: datetime.datetime, tree: str) -> str:
    """The block written between the markers."""
    rows = "\n".join(r.line() for r in results)
    total = sum(r.seconds for r in results) / 60
    return (f"{BEGIN}\nLast green `make test-long` (written by the run itself, "
            "`scripts/test_long.py`): started "
            f"{started:%Y-%m-%d %H:%M} UTC, commit {tree}, {total:.0f} minutes.\n\n"
            "| invocation | passed | failed | errors | skipped | minutes |\n"
            f"|---|---|---|---|---|---|\n{rows}\n{END}")


def rewrite(text: str, block: str) -> str:
    """``text`` with the marked block replaced by ``block`` (the markers must be there, once)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"{DOC}: expected one {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return head + block + tail


def main() -> int:
    started = datetime.datetime.now(datetime.timezone.utc)
    tree = tree_state()  # at the start: the code the tests ran
    with tempfile.TemporaryDirectory(prefix="test-long-") as tmp:
        results = [run(args, Path(tmp), n) for n, args in enumerate(INVOCATIONS)]
    for result in results:
        print(f"test-long: {result.line()} exit {result.code}")
    if not all(r.green for r in results):
        print("test-long: not green: docs/testing.md keeps its previous record", file=sys.stderr)
        return 1
    DOC.write_text(rewrite(DOC.read_text(), record(results, started, tree)))
    print(f"test-long: green: recorded in {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
