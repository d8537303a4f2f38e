"""Every relative link in README.md and docs/ leads somewhere: the file exists and, where the link
names an anchor in a Markdown file, a heading of that file has it (GitHub's slugs)."""

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# `[text](target)` and `![alt](target)`, the target up to whitespace or `)`, an optional "title".
LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def _unfenced(text: str) -> str:
    """The text with its fenced code blocks blanked: a `#` line there is no heading, nor a link."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            line = ""
        lines.append("" if fenced else line)
    return "\n".join(lines)


def _prose(text: str) -> str:
    """The unfenced text with each code span replaced by a word: a span holds no link, yet may hold
    `](`. Spans may cross a line break, so this works on the whole text, not line by line."""
    prose = re.sub(r"``.+?``", "code", _unfenced(text), flags=re.DOTALL)
    return re.sub(r"`[^`]*`", "code", prose)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link markup reduced to its text, lower case, punctuation other
    than `-` and `_` dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(_unfenced(path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """Each relative link of `page` whose file is missing or whose anchor no heading has."""
    problems = []
    for target in LINK.findall(_prose(page.read_text())):
        if EXTERNAL.match(target):
            continue
        path_part, _, anchor = unquote(target).partition("#")
        dest = (page.parent / path_part) if path_part else page
        if not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading with that anchor in {dest.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    problems = broken_links(page)
    assert not problems, f"broken links in {page.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_manual_has_its_pages():
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {"configuration.md", "launching.md", "data.md", "compression.md", "elastic.md",
            "checkpoints.md", "slurm.md", "monitoring.md", "gpus-and-precision.md", "setup.md",
            "testing.md", "benchmarks.md"} <= names
    readme = (ROOT / "README.md").read_text()
    for name in names:
        assert f"](docs/{name}" in readme, f"README's index does not link docs/{name}"


def test_a_missing_file_and_a_missing_anchor_are_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Data on disk, `npy` too\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\nSee [the other](other.md#data-on-disk-npy-too), [this](#page) and\n"
        "[a page that is gone](gone.md), [a heading that is gone](other.md#nothing-here),\n"
        "[here](#nowhere), [out](https://example.org/x.md#y).\n\n"
        "```\n[not a link](inside-a-code-block.md)\n```\n`[nor](in-a-code-span.md)`\n")
    assert broken_links(page) == [
        "gone.md: no such file",
        "other.md#nothing-here: no heading with that anchor in other.md",
        "#nowhere: no heading with that anchor in page.md",
    ]


@pytest.mark.parametrize("heading, expected", [
    ("TensorBoard, W&B and reports", "tensorboard-wb-and-reports"),
    ("Gradient compression (5 seeds, torch/tensorflow)", "gradient-compression-5-seeds-torchtensorflow"),
    ("Start-up: `hvdtrain train` vs a script", "start-up-hvdtrain-train-vs-a-script"),
    ("See [the code](x.py) first", "see-the-code-first"),
])
def test_slugs_follow_github(heading, expected):
    assert slug(heading) == expected
