"""The unit tier's rule: run on their own, the unit tests load no framework (the core imports
neither PyTorch nor TensorFlow, nor Horovod)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

FRAMEWORKS = ("torch", "tensorflow", "horovod", "keras")
"""The top-level modules the core and its unit tests must never load."""

UNIT = Path(__file__).parent


ONLY_UNIT = pytest.StashKey[bool]()
"""Whether the session collected only unit tests: otherwise collecting the others loaded their
frameworks, deselected or not (``pytest -m unit`` over every tier), and the rule cannot be checked."""


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: what was collected, not what will run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[ONLY_UNIT] = bool(items) and all(UNIT in Path(str(item.path)).parents
                                                  for item in items)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails a session that collected only unit tests if, by its end, a framework was loaded.

    Checked over the whole session, not in one test: whichever test loads a framework (an import in
    a function body included) is caught. A session that also collected the other tiers holds their
    frameworks, so there the rule cannot be checked; ``make test`` and ``make test-fast`` run the
    unit tier on its own.
    """
    if not session.config.stash.get(ONLY_UNIT, False):
        return
    loaded = [name for name in FRAMEWORKS if name in sys.modules]
    if loaded:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"the unit tests loaded {', '.join(loaded)}: the core must import no framework"
        if reporter is not None:
            reporter.line("")  # the progress line is still open
            reporter.write_sep("=", f"FAILED: {message}", red=True, bold=True)
        else:
            print(message, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
