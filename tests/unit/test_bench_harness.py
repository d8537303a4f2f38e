"""The benchmark harness's statistics, parsing and table writing on canned inputs."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts" / "bench"))
import harness  # noqa: E402


def test_summarize_gives_min_median_max_and_ratio_to_baseline():
    rows = harness.summarize({"A": [3.0, 1.0, 2.0], "B": [4.0, 2.0, 6.0, 5.0]}, baseline="A")
    assert [(r.name, r.runs, r.min, r.median, r.max) for r in rows] == [
        ("A", 3, 1.0, 2.0, 3.0), ("B", 4, 2.0, 4.5, 6.0)]
    assert [r.ratio for r in rows] == [1.0, 2.25]


@pytest.mark.parametrize("samples, message", [
    ({"A": [1.0]}, "baseline 'X' is not among"), ({"X": [1.0], "B": []}, "no samples for: B"),
    ({"X": [0.0]}, "non-positive median")])
def test_summarize_rejects_bad_input(samples, message):
    with pytest.raises(ValueError, match=message):
        harness.summarize(samples, baseline="X")


def test_markdown_table_and_section(tmp_path):
    rows = harness.summarize({"A": [0.010, 0.012], "B": [0.0111]}, baseline="A")
    table = harness.markdown_table(rows)
    assert table.splitlines()[2] == "| A | 2 | 10.000 | 11.000 | 12.000 | 1.000 |"
    assert table.splitlines()[3] == "| B | 1 | 11.100 | 11.100 | 11.100 | 1.009 |"
    section = harness.markdown_section("T", "python x.py --flag", {"cores": 2}, rows, ["a note"],
                                       date="2026-01-01")
    doc = tmp_path / "docs" / "b.md"
    harness.append_markdown(doc, section, "# Head\n")
    harness.append_markdown(doc, section, "# Head\n")
    text = doc.read_text()
    assert text.startswith("# Head\n\n## T\n") and text.count("python x.py --flag") == 2
    assert "Machine: cores: 2." in text and "- a note" in text


def test_parse_measurement_reads_tagged_launcher_output():
    out = ("[1]<stdout>:noise\n[0]<stdout>:{\"step_time_s\": 0.5, \"steps\": 3}[1,0]<stdout>:\n"
           "{\"other\": 1}\n")
    assert harness.parse_measurement(out, "step_time_s") == {"step_time_s": 0.5, "steps": 3}
    with pytest.raises(ValueError, match="no JSON line with key 'missing'"):
        harness.parse_measurement(out, "missing")


def test_round_order_alternates():
    cmds = [harness.Command("A", []), harness.Command("B", []), harness.Command("C", [])]
    assert [c.name for c in harness.round_order(cmds, 0)] == ["A", "B", "C"]
    assert [c.name for c in harness.round_order(cmds, 1)] == ["C", "B", "A"]


def test_machine_record_names_cores_and_versions():
    record = harness.machine_record()
    assert record["cores"] >= 1 and record["torch"].startswith("2.13.0")
