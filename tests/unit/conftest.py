"""The unit tier's rule: run on their own, the unit tests load no framework (the core imports
neither PyTorch nor TensorFlow, nor Horovod)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

FRAMEWORKS = ("torch", "tensorflow", "horovod", "keras")
"""The top-level modules the core and its unit tests must never load."""

UNIT = Path(__file__).parent


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails a session that ran only unit tests if, by its end, a framework was loaded.

    Checked over the whole session, not in one test: whichever test loads a framework (an import in
    a function body included) is caught. A session that also ran the other tiers holds their
    frameworks, so there the rule cannot be checked; ``make test`` runs the unit tier on its own.
    """
    items = getattr(session, "items", [])
    if not items or not all(UNIT in Path(str(item.path)).parents for item in items):
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
