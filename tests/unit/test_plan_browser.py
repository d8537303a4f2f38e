"""``hvdtrain plan --html`` opened in a real headless browser (Debian's ``chromium``, installed by
scripts/setup.sh): the page's script finds every scaling curve drawn with a length."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from hvdtrain.plan.cluster import load_cluster
from hvdtrain.plan.html import write_html
from hvdtrain.plan.predict import Knobs, plan
from hvdtrain.plan.profile import load_profile

PUBLISHED = Path(__file__).resolve().parents[2] / "hvdtrain" / "plan" / "published"


def test_the_browser_draws_every_curve(tmp_path: Path) -> None:
    browser = shutil.which("chromium")
    assert browser, "chromium is missing: run scripts/setup.sh (it installs Debian's chromium)"
    result = plan(load_profile(PUBLISHED / "inception_v3.json"),
                  load_cluster(PUBLISHED / "horovod_paper.yaml"), Knobs(64))
    page = tmp_path / "plan.html"
    write_html(result, page)
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                           f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(r"<p id=\"rendered\">curves drawn: (\d+) of (\d+)</p>", proc.stdout)
    assert found, proc.stdout[-2000:]
    drawn, total = map(int, found.groups())
    expected = sum(1 for p in result.predictions if p.best is not None)
    assert drawn == total == expected > 5
