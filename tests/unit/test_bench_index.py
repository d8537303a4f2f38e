"""The index of docs/benchmarks.md against the sections it is generated from (benchmarks/index.py)."""

import subprocess
import sys

import pytest

from benchmarks import index

SECTION = """## A title: with (punctuation), `code` and 2 parts

<!-- index: Label A | a.py --flag | ratio <= 1.1 -->
Verdict: met: 1.050, A/A 1.000

Date: d

```
## not a heading: inside a fence
```

- Result, a note.
"""


def doc(*sections: str) -> str:
    return f"# Benchmarks\n\nText.\n\n{index.BEGIN}\nstale\n{index.END}\n\n" + "\n".join(sections)


def test_the_index_of_docs_benchmarks_is_what_its_sections_give():
    text = index.DOC.read_text()
    assert index.has_index(text)
    assert index.render(text) == text, "run: .venv/bin/python -m benchmarks.index"


def test_every_section_of_docs_benchmarks_has_its_row():
    text = index.DOC.read_text()
    titles = [line[3:] for line in text.splitlines() if line.startswith("## ")]
    assert [title for title, _ in index.sections(text)] == titles and len(titles) >= 10
    table = index.table(text)
    assert all(f"(#{index.slug(title)})" in table for title in titles)


def test_render_builds_a_row_a_section_in_order_and_keeps_the_rest():
    other = SECTION.replace("## A title", "## B").replace("Label A", "Label B").replace(
        "met: 1.050", "missed | by 0.1")
    text = doc(SECTION, other)
    new = index.render(text)
    assert "stale" not in new and new.endswith(other) and new.startswith("# Benchmarks\n\nText.")
    rows = new.split(index.BEGIN + "\n")[1].split(index.END)[0].splitlines()
    assert rows[:2] == index.HEADER.splitlines()
    assert rows[2:] == [
        "| [Label A](#a-title-with-punctuation-code-and-2-parts) | `a.py --flag` | ratio <= 1.1 | "
        "met: 1.050, A/A 1.000 |",
        "| [Label B](#b-with-punctuation-code-and-2-parts) | `a.py --flag` | ratio <= 1.1 | "
        "missed \\| by 0.1, A/A 1.000 |"]
    assert index.render(new) == new


@pytest.mark.parametrize("broken", [
    SECTION.replace("Verdict: met: 1.050, A/A 1.000\n", ""),
    SECTION.replace("<!-- index: Label A | a.py --flag | ratio <= 1.1 -->\n", ""),
    SECTION.replace(" | ratio <= 1.1", ""),
    SECTION + "Verdict: a second one\n"])
def test_a_section_without_exactly_one_index_line_and_verdict_is_refused(broken):
    with pytest.raises(index.IndexFormatError):
        index.render(doc(broken))


def test_render_needs_both_markers_and_refresh_leaves_a_file_without_them(tmp_path):
    with pytest.raises(index.IndexFormatError):
        index.render(doc(SECTION).replace(index.END + "\n", ""))
    scratch = tmp_path / "scratch.md"
    scratch.write_text("# Benchmarks\n\n" + SECTION.replace("Verdict: ", "Not a verdict: "))
    assert index.refresh(scratch) is False
    kept = tmp_path / "kept.md"
    kept.write_text(doc(SECTION))
    assert index.refresh(kept) is True and "stale" not in kept.read_text()
    assert index.refresh(kept) is False


def test_entry_lines_are_read_back_and_fields_cannot_hold_the_separator():
    entry = index.Entry(label="L", script="s.py", target="t", verdict="v, figures")
    assert index.parse("## T\n\n" + entry.lines()) == entry
    with pytest.raises(index.IndexFormatError):
        index.Entry(label="a | b", script="s", target="t", verdict="v").lines()
    with pytest.raises(index.IndexFormatError):
        index.Entry(label="a", script="s", target="t", verdict="two\nlines").lines()


def test_the_generator_runs_by_hand_and_its_check_fails_on_a_stale_index(tmp_path):
    path = tmp_path / "benchmarks.md"
    path.write_text(doc(SECTION))
    check = [sys.executable, "-m", "benchmarks.index", "--check", str(path)]
    root = index.DOC.parents[1]
    assert subprocess.run(check, cwd=root, capture_output=True).returncode == 1
    assert "stale" in path.read_text()
    subprocess.run([sys.executable, str(root / "benchmarks" / "index.py"), str(path)], check=True,
                   capture_output=True)
    assert subprocess.run(check, cwd=root, capture_output=True).returncode == 0
