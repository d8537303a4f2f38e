"""Each benchmark of ``benchmarks/``, and the investigations' drivers, in its smallest
configuration (``--quick``), end to end.

Real jobs (``horovodrun``, ``torchrun``), real measurements, nothing timed or compared: the tests
check that every driver runs its variants, writes its section with the tables' columns and one run
of each variant, and that the ratios in the tables are the ones its records give.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# At import, not in the test: TensorFlow sets environment variables when first imported, which the
# leak check would pin on the test that happened to import it.
import hvdtrain.tensorflow.models  # noqa: F401
from hvdtrain.registry import DATASETS, MODELS
from tests.conftest import ROOT, run_env

BENCH = ROOT / "benchmarks"
ALLREDUCE = ROOT / "docs" / "investigations" / "allreduce-bandwidth" / "allreduce.py"
FUSION = ROOT / "docs" / "investigations" / "tensor-fusion" / "fusion.py"
sys.path[:0] = [str(BENCH), str(FUSION.parent)]
import fusion  # noqa: E402

import ddp  # noqa: E402
import frameworks  # noqa: E402
import harness  # noqa: E402
import index  # noqa: E402
import monitoring  # noqa: E402
import overhead  # noqa: E402
import scaling  # noqa: E402
import startup  # noqa: E402

ONE_DENSE = ("--train-extra", "comm.dense_steps=1")
"""The quick compression runs (10 to 25 steps) set one dense step: the default dense start,
at least ``comm.dense_min_steps`` (30), would average every step of them dense and leave no
compression to check (the driver gives the key to the compressing runs only)."""


def run_driver(doc: Path, script: str | Path, *args: str) -> None:
    """Runs ``script --quick`` (a file name in ``benchmarks/`` or a path) writing its section
    into ``doc``; fails with the output's tail."""
    proc = subprocess.run([sys.executable, str(BENCH / script), "--quick", "--output", str(doc),
                           *args], cwd=ROOT, env=run_env(), capture_output=True, text=True,
                          timeout=840)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def sections(doc: Path, indexed: bool = True) -> dict[str, list[list[list[str]]]]:
    """Each section's tables by its title; a table is its rows of cells, header first, the rule
    line left out. With ``indexed`` (the drivers of ``benchmarks/``; an investigation's are not
    indexed), every section carries its index lines (``index.py``)."""
    for title, entry in index.sections(doc.read_text()) if indexed else ():
        assert entry.verdict and entry.script.split()[0].endswith(".py"), title
    found: dict[str, list[list[list[str]]]] = {}
    title, previous = "", ""
    for line in doc.read_text().splitlines():
        if line.startswith("## "):
            title, found[line[3:]] = line[3:], []
        elif line.startswith("|") and not line.startswith("|---"):
            if not previous.startswith("|"):
                found[title].append([])
            found[title][-1].append([c.strip() for c in line.strip().strip("|").split("|")])
        previous = line
    return found


def check_rows(table: list[list[str]], names: list[str]) -> None:
    """Harness table columns, one run of each of ``names`` in order, the baseline's ratio 1."""
    assert [c.split(" (")[0] for c in table[0]] == list(harness.TABLE_COLUMNS)
    assert [row[0] for row in table[1:]] == names
    assert [row[1] for row in table[1:]] == ["1"] * len(names)
    assert table[1][5] == "1.000"


@pytest.mark.long
@pytest.mark.timeout(900)
def test_step_time_benchmarks_tabulate_the_ratios_of_their_records(tmp_path):
    """overhead.py (both frameworks), frameworks.py and monitoring.py: one interleaved job each."""
    doc, measured = tmp_path / "bench.md", []
    steps = [overhead.BASELINE, overhead.CANDIDATE, overhead.CONTROL]
    for number, (script, args, names, key) in enumerate((
            ("overhead.py", ["--framework", "torch"], steps, "step_time_s"),
            ("overhead.py", ["--framework", "tensorflow"], steps, "step_time_s"),
            ("frameworks.py", [], [frameworks.BASELINE, frameworks.CANDIDATE, frameworks.CONTROL],
             "samples_per_s"),
            ("monitoring.py", [], [monitoring.OFF, monitoring.ON, monitoring.CONTROL],
             "step_time_s"))):
        records = tmp_path / f"records{number}.jsonl"
        run_driver(doc, script, *args, "--records", str(records))
        runs = [json.loads(line) for line in records.read_text().splitlines()]
        assert [run["slot"] for run in runs] == [0, 1, 2]
        assert {"step_time_s", "steady_step_time_s", "samples_per_s", "steady_samples_per_s",
                "eval_accuracy", "round", "variant"} <= set(runs[0])
        measured.append((names, key, runs))
    found = sections(doc)
    assert len(found) == 4 and all(len(tables) == 2 for tables in found.values())
    for (names, key, runs), tables in zip(measured, found.values(), strict=True):
        check_rows(tables[0], names)
        check_rows(tables[1], names)
        assert tables[0][2][5] == f"{runs[1][key] / runs[0][key]:.3f}"  # B over A, whole run


@pytest.mark.long
@pytest.mark.timeout(900)
def test_startup_launches_each_side_whole_and_reads_its_first_step(tmp_path):
    doc = tmp_path / "bench.md"
    run_driver(doc, "startup.py", "--framework", "torch")
    (tables,) = sections(doc).values()
    check_rows(tables[0], [startup.BASELINE, startup.CANDIDATE, startup.CONTROL])
    assert all(float(row[3]) > 0 for row in tables[0][1:])


@pytest.mark.long
@pytest.mark.timeout(900)
def test_allreduce_and_fusion_smallest_runs(tmp_path):
    doc = tmp_path / "bench.md"
    run_driver(doc, ALLREDUCE)
    run_driver(doc, FUSION)
    (allreduce_tables, fusion_tables) = sections(doc, indexed=False).values()
    assert len(allreduce_tables) == 2  # Gloo and MPI
    for table in allreduce_tables:
        assert [row[0] for row in table[1:]] == ["4 KB", "64 KB"]
        assert all(float(cell.split(" (")[0]) > 0 for row in table[1:] for cell in row[1:])
    check_rows(fusion_tables[0], [fusion.BASELINE, fusion.CANDIDATE, fusion.CONTROL])


@pytest.mark.long
@pytest.mark.timeout(900)
def test_ddp_and_scaling_smallest_runs(tmp_path):
    doc = tmp_path / "bench.md"
    run_driver(doc, "ddp.py")
    run_driver(doc, "scaling.py")
    (ddp_tables, scaling_tables) = sections(doc).values()
    check_rows(ddp_tables[0], [ddp.BASELINE, ddp.GLOO, ddp.MPI, ddp.HANDWRITTEN, ddp.CONTROL])
    check_rows(scaling_tables[0], [scaling.ONE, scaling.TWO, scaling.CEILING, scaling.CONTROL])


@pytest.mark.long
@pytest.mark.timeout(900)
def test_compression_checkpoint_and_recovery_smallest_runs(tmp_path):
    doc = tmp_path / "bench.md"
    run_driver(doc, "compression.py", *ONE_DENSE)
    run_driver(doc, "checkpoint.py", "--hidden", "64")
    run_driver(doc, "elastic_recovery.py", "--frameworks", "torch")
    (compression_tables, checkpoint_tables, recovery_tables) = sections(doc).values()
    losses, per_method = compression_tables[0], compression_tables[1]
    assert [row[0] for row in losses[1:]] == ["torch digits sgd topk", "torch digits sgd powersgd"]
    rows = {row[0]: row for row in per_method[1:]}
    assert set(rows) == {"torch digits sgd none", "torch digits sgd topk",
                         "torch digits sgd powersgd"}
    assert rows["torch digits sgd none"][5] == "1.0" and float(rows["torch digits sgd topk"][5]) > 10
    assert len(checkpoint_tables[0]) == 5 and checkpoint_tables[0][1][5] == "1.000"
    assert [row[0] for row in recovery_tables[0][1:]] == ["torch"]


@pytest.mark.timeout(600)
def test_compression_smallest_run_of_the_language_model(tmp_path):
    """``--datasets lm``: the LM config on the docs corpus the driver makes, measured by eval
    perplexity in tables of its own, and judged by the relative increase against ``none``."""
    doc = tmp_path / "bench.md"
    run_driver(doc, "compression.py", "--datasets", "lm", "--methods", "none,topk", *ONE_DENSE,
               "--work", str(tmp_path / "work"))
    (losses, results), = sections(doc).values()
    assert losses[0][2] == "perplexity increase vs none (%)"
    assert [row[0] for row in losses[1:]] == ["torch lm adam topk"]
    rows = {row[0]: row for row in results[1:]}
    assert results[0][2] == "perplexity mean" and set(rows) == {"torch lm adam none",
                                                                  "torch lm adam topk"}
    none, topk = (float(rows[f"torch lm adam {m}"][2]) for m in ("none", "topk"))
    assert 1 < none < 100 and float(rows["torch lm adam topk"][5]) > 10  # 20 steps from 256
    # One seed: the loss is the relative increase of the two means, which the table prints to
    # 0.01; the ratio of the printed means is off by up to 0.005 (topk + none) / none^2.
    rounding = 100 * 0.005 * (topk + none) / none**2 + 0.005
    assert float(losses[1][2]) == pytest.approx(100 * (topk / none - 1), abs=2 * rounding)
    assert (tmp_path / "work" / "docs-text" / "train.bin").stat().st_size > 100_000
    assert "train.max_steps=20" in doc.read_text()


@pytest.mark.timeout(600)
def test_compression_smallest_run_of_resnet18_on_generated_images(tmp_path):
    """``--datasets images``: ResNet-18's config on images the driver generates, measured by eval
    accuracy, with its own title and the issue's bars."""
    doc = tmp_path / "bench.md"
    run_driver(doc, "compression.py", "--datasets", "images", "--methods", "none,topk", *ONE_DENSE,
               "--work", str(tmp_path / "work"))
    (title, (losses, results)), = sections(doc).items()
    assert "ResNet-18 on generated images, 10 steps" in title
    assert losses[0][2] == "loss vs none (points)"
    assert [row[0] for row in losses[1:]] == ["torch images adam topk"] and losses[1][4] == "1"
    rows = {row[0]: row for row in results[1:]}
    assert set(rows) == {"torch images adam none", "torch images adam topk"}
    # One dense step (ONE_DENSE) of ten: 10 / (1 + 9 / r) for top-k's own ratio r (about 41
    # here) is 8.2.
    assert rows["torch images adam none"][5] == "1.0" and 7 < float(rows["torch images adam topk"][5]) < 10
    none, topk = (float(rows[f"torch images adam {m}"][2]) for m in ("none", "topk"))
    assert float(losses[1][2]) == pytest.approx(100 * (none - topk), abs=0.011)
    assert len(list((tmp_path / "work" / "images" / "train").rglob("*.jpg"))) == 4000
    assert "train.max_steps=10" in doc.read_text()


def test_resnet18_has_resnet18_size_and_trains_on_synthetic_images():
    import torch

    data = DATASETS.get("synthetic_images")(train_samples=8, test_samples=2)
    model = MODELS["torch"].get("resnet18")().build(data.spec())
    assert sum(p.numel() for p in model.parameters()) == 11_181_642  # torchvision's, 10 classes
    logits = model(torch.from_numpy(data.train().x[:4]))
    assert logits.shape == (4, 10)
    narrow = MODELS["torch"].get("resnet18")(width=8).build(data.spec())
    assert sum(p.numel() for p in narrow.parameters()) < 200_000


def test_tensorflow_resnet18_matches_the_torch_parameter_count():
    data = DATASETS.get("synthetic_images")(train_samples=4, test_samples=2)
    model = MODELS["tensorflow"].get("resnet18")().build(data.spec())
    assert sum(int(np.prod(v.shape)) for v in model.trainable_variables) == 11_181_642
    assert tuple(model(data.train().x).shape) == (4, 10)


@pytest.mark.long
def test_ps_memory_smallest_run_shards_the_optimizer_state(tmp_path):
    doc = tmp_path / "bench.md"
    run_driver(doc, "ps_memory.py")
    (table,) = next(iter(sections(doc).values()))
    rows = {(row[0], row[1]): float(row[2].split()[0]) for row in table[1:]}
    assert set(rows) == {(n, p) for n in ("2", "4") for p in ("ring", "colocated")}
    for n in (2, 4):  # the whole state on the ring, 1/N of it colocated (rounded to 0.01 MB)
        assert rows[str(n), "colocated"] == pytest.approx(rows[str(n), "ring"] / n, abs=0.01)
