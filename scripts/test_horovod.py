"""Runs Horovod's own parallel test suites against the Horovod that `make setup` installed.

Each suite runs at 2 ranks under Gloo and under MPI (`horovodrun -np 2 --gloo|--mpi python -m pytest
SUITE`); the tests listed in tests/horovod/known_artifacts.txt, and only those, are deselected. A
table of passed, failed and skipped per suite and controller ends the output; the full logs are kept
in runs/test-horovod/. Exit status 1 when any suite fails or gives no result.

Horovod's sdist does not ship its tests: they are read from HOROVOD_TESTS (a folder holding
v0.28.1's test/parallel and test/utils), by default ../shared/horovod-tests beside the checkout.

Usage: python scripts/test_horovod.py [--suite test_torch.py ...] [--controller gloo|mpi ...]
                                      [--select PYTEST_K_EXPRESSION]
"""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "tests" / "horovod" / "known_artifacts.txt"
LOGS = ROOT / "runs" / "test-horovod"
PLUGIN_DIR = ROOT / "tests" / "horovod"
# Per suite and controller; HVDTRAIN_HOROVOD_TESTS_TIMEOUT overrides it on a busy machine.
TIMEOUT_S = int(os.environ.get("HVDTRAIN_HOROVOD_TESTS_TIMEOUT", "3600"))
SUITES = ("test_torch.py", "test_tensorflow.py", "test_tensorflow2_keras.py",
          "test_tensorflow_process_sets.py", "test_tensorflow_process_sets_dynamic.py",
          "test_tensorflow2_keras_process_sets.py", "test_process_sets_static.py")
CONTROLLERS = ("gloo", "mpi")
OUTCOMES = ("passed", "failed", "skipped", "errors")
# Rank 0's lines: "[0]<stdout>:" under Gloo, "[1,0]<stdout>:" under Open MPI.
RANK0 = re.compile(r"^\[(?:\d+,)?0\]<stdout>:(.*)$")
SUMMARY = re.compile(r"\b(\d+) (passed|failed|skipped|errors?|deselected)\b")
HOW_TO_GET = """Horovod's test suites were not found{where}.
Horovod's sdist does not ship them. Get v0.28.1's test/ folder from a Horovod checkout:
    git clone --depth 1 --branch v0.28.1 https://github.com/horovod/horovod.git /some/dir
and point HOROVOD_TESTS at it:  make test-horovod HOROVOD_TESTS=/some/dir"""


def tests_dir() -> Path:
    """The folder with test/parallel: HOROVOD_TESTS, else ../shared/horovod-tests; exits if none."""
    given = os.environ.get("HOROVOD_TESTS")
    folder = Path(given) if given else ROOT.parent / "shared" / "horovod-tests"
    if not (folder / "test" / "parallel").is_dir():
        where = f" in HOROVOD_TESTS={given}" if given else f" (looked in {folder})"
        sys.exit(HOW_TO_GET.format(where=where))
    return folder / "test" / "parallel"


def known_artifacts(path: Path = ARTIFACTS) -> dict[str, str]:
    """Test id (suite::class::test) -> why it is a test artifact, from the artifacts file."""
    artifacts = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            test_id, reason = (part.strip() for part in line.split("|", 1))
            artifacts[test_id] = reason
    return artifacts


def command(suite: str, controller: str, select: str | None = None) -> list[str]:
    """The horovodrun command line for one suite under one controller (`select`: pytest's -k)."""
    bin_dir = Path(sys.executable).parent
    pytest = [str(bin_dir / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
              "--color=no", "-p", "deselect_artifacts", suite]
    if select:
        pytest += ["-k", select]
    return [str(bin_dir / "horovodrun"), "-np", "2", f"--{controller}", *pytest]


def summary(log: str) -> dict[str, int]:
    """Counts from rank 0's last pytest summary line (`3 failed, 102 passed, 10 skipped in ...`)."""
    counts: dict[str, int] = {}
    for line in log.splitlines():
        match = RANK0.match(line)
        if match and " in " in match.group(1) and SUMMARY.search(match.group(1)):
            counts = {}
            for number, outcome in SUMMARY.findall(match.group(1)):
                counts["errors" if outcome.startswith("error") else outcome] = int(number)
    return counts


def run(suite: str, controller: str, folder: Path, artifacts: dict[str, str],
        select: str | None = None) -> dict[str, int]:
    """Runs one suite, keeps its log, returns its counts (empty when pytest gave no summary)."""
    deselect = [test_id for test_id in artifacts if test_id.split("::")[0] == suite]
    # The plugin tests/horovod/deselect_artifacts.py drops exactly these ids (--deselect takes
    # prefixes).
    plugin_path = os.pathsep.join(filter(None, [str(PLUGIN_DIR), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PYTHONUNBUFFERED": "1", "PYTHONPATH": plugin_path,
           "HVDTRAIN_DESELECT": "\n".join(deselect)}
    print(f"==> [test-horovod] {suite} under {controller} "
          f"({len(deselect)} known artifacts deselected)", flush=True)
    try:
        proc = subprocess.run(command(suite, controller, select), cwd=folder, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
        output, returncode = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as stopped:  # keep what it printed; count it as an error
        printed = stopped.stdout or ""
        output = printed.decode(errors="replace") if isinstance(printed, bytes) else printed
        output, returncode = output + f"\n!!! stopped after {TIMEOUT_S} s\n", -1
    log = LOGS / f"{Path(suite).stem}-{controller}.log"
    log.write_text(output)
    counts = summary(output)
    counts["deselected"] = len(deselect)
    if returncode != 0 and not counts.get("failed") and not counts.get("errors"):
        counts["errors"] = counts.get("errors", 0) + 1  # a crash or abort: no test summary to trust
    return counts


def table(results: dict[tuple[str, str], dict[str, int]]) -> str:
    """A Markdown table: one row per suite and controller."""
    lines = ["| suite | controller | passed | failed | skipped | errors | known artifacts |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for (suite, controller), counts in results.items():
        cells = [str(counts.get(key, 0)) for key in (*OUTCOMES, "deselected")]
        lines.append(f"| {suite} | {controller} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs the chosen suites under the chosen controllers; prints the table; 1 on any failure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", action="append", choices=SUITES, help="default: all")
    parser.add_argument("--controller", action="append", choices=CONTROLLERS, help="default: both")
    parser.add_argument("--select", help="only the tests matching this pytest -k expression")
    args = parser.parse_args(argv)
    folder, artifacts = tests_dir(), known_artifacts()
    LOGS.mkdir(parents=True, exist_ok=True)
    results = {(suite, controller): run(suite, controller, folder, artifacts, args.select)
               for suite in args.suite or SUITES for controller in args.controller or CONTROLLERS}
    print(table(results))
    print(f"Logs: {LOGS}; known artifacts and their reasons: {ARTIFACTS.relative_to(ROOT)}")
    bad = [key for key, counts in results.items() if counts.get("failed") or counts.get("errors")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
