"""docs/configuration.md's reference is generated from the config's dataclasses
(hvdtrain/config_page.py): stale tables fail here, with the command that regenerates them."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from hvdtrain import config
from hvdtrain.config_page import (
    COMMAND,
    PAGE,
    allowed_text,
    blocks,
    field_docs,
    markdown_text,
    render,
    tables,
)

REGENERATE = f"docs/configuration.md's reference is stale; regenerate: {COMMAND}"


def test_docs_configuration_reference_is_current():
    page = PAGE.read_text()
    assert render(page) == page, REGENERATE
    stale = page.replace("| `train.epochs` | `10` |", "| `train.epochs` | `11` |")
    assert stale != page
    assert render(stale) == page


def test_every_section_has_one_block_and_every_block_a_section():
    names = [m for m in PAGE.read_text().splitlines() if m.startswith("<!-- reference: ")]
    assert len(names) == len(blocks(PAGE.read_text())), "a section has two blocks"
    assert sorted(blocks(PAGE.read_text())) == sorted(tables()), REGENERATE
    with pytest.raises(ValueError, match=r"no block for \['log'\]"):
        render(PAGE.read_text().replace("<!-- reference: log -->", "<!-- logs -->"))


def test_every_key_has_a_docstring():
    sections = [config.Config, *(t for t in typing.get_type_hints(config.Config).values()
                                 if isinstance(t, type) and dataclasses.is_dataclass(t))]
    for cls in sections:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            nested = dataclasses.is_dataclass(typing.get_type_hints(cls)[f.name])
            assert nested or docs.get(f.name, "").strip(), f"{cls.__name__}.{f.name}: no docstring"


def test_a_row_gives_default_type_allowed_values_and_docstring():
    rows = tables()
    assert ("| `train.device` | `auto` | string | `auto`, `cpu`, `cuda` | Where each rank "
            "computes:") in rows["train"]
    assert "| `comm.cycle_time_ms` | `0.0` | number | 0 to 1000 | How often" in rows["comm"]
    assert "| `log.dir` | `\"\"` | string |  | Run directory" in rows["log"]
    assert "| `pipeline.split` | `auto` | string or list |  |" in rows["pipeline"]
    assert "| `seed` | `0` | integer | >= 0 | Base seed" in rows["top"]


def test_ranges_and_docstrings_as_markdown():
    fields = {f.name: f for f in dataclasses.fields(config.DataConfig)}
    assert allowed_text(fields["workers"], int) == ">= -1"
    assert allowed_text(fields["batch_size"], int) == ">= 1"
    optim = {f.name: f for f in dataclasses.fields(config.OptimConfig)}
    assert allowed_text(optim["momentum"], float) == "0 to 1"
    assert allowed_text(optim["name"], str) == "`sgd`, `adam`, `adamw`"
    assert markdown_text("A ``key``, :mod:`hvdtrain.device` and :func:`~a.b.fn`,\n    see "
                         "docs/pipeline.md; a | b.") == (
        "A `key`, `hvdtrain.device` and `fn`, see [pipeline.md](pipeline.md); a \\| b.")
