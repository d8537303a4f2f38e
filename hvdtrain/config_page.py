"""docs/configuration.md's reference of every key, generated from the config's dataclasses
(:mod:`hvdtrain.config`): per section a table of each key's default, type, allowed values or
range, and the docstring under its field.

``python -m hvdtrain.config_page`` prints the tables; ``--write`` puts each between its markers
in docs/configuration.md (``<!-- reference: SECTION -->`` ... ``<!-- end reference -->``), leaving
the hand-written prose around them as it is. A unit test fails when the page is stale.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import re
import sys
import typing
from pathlib import Path
from typing import Any

from hvdtrain import config
from hvdtrain.configcheck import INT_MAX, field_default

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
"""The page whose marked blocks :func:`write` rewrites."""

TOP = "top"
"""The block of the keys at the top level (``name``, ``framework``, ``seed``)."""

COMMAND = "python -m hvdtrain.config_page --write"
"""The command that regenerates the page's reference."""

_BLOCK = re.compile(r"(<!-- reference: ([\w]+) -->\n)(.*?)(<!-- end reference -->)", re.DOTALL)
_ROLE = re.compile(r":(?:mod|func|class|data|meth|attr):`(~?)([^`]+)`")
_PAGE_NAME = re.compile(r"\bdocs/([\w-]+\.md)")
_TYPES = {bool: "bool", int: "integer", float: "number", str: "string", dict: "mapping",
          list: "list"}


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls``, by field name (read from the source:
    Python keeps no attribute docstrings at run time)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = after.value.value
    return docs


def markdown_text(doc: str) -> str:
    """A docstring as one line of Markdown for a table cell: reST literals and roles become code
    spans, ``docs/PAGE.md`` a link to that page, whitespace one space, a ``|`` escaped."""
    text = _ROLE.sub(lambda m: f"`{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}`", doc)
    text = _PAGE_NAME.sub(r"[\1](\1)", text.replace("``", "`"))
    return " ".join(text.split()).replace("|", "\\|")


def default_text(value: Any) -> str:
    """A default as docs/configuration.md writes it (``true``, ``""``, ``{}``, ``0.05``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return '""'
    return str(value)


def type_text(ftype: Any) -> str:
    """A field's type in words (``integer``, ``string or list``)."""
    return " or ".join(_TYPES.get(t, getattr(t, "__name__", str(t)))
                       for t in typing.get_args(ftype) or (ftype,))


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else f"{value:g}"


def allowed_text(f: dataclasses.Field, ftype: Any) -> str:
    """What validation accepts: the choices, or the range (an integer without a maximum of its own
    stops at :data:`hvdtrain.configcheck.INT_MAX`, which the page says once, not in every row)."""
    choices, lo, hi = (f.metadata.get(k) for k in ("choices", "min", "max"))
    if choices:
        return ", ".join(f"`{c}`" for c in choices)
    if hi == INT_MAX and ftype is int:
        hi = None
    if lo is not None and hi is not None:
        return f"{_number(lo)} to {_number(hi)}"
    if lo is not None:
        return f">= {_number(lo)}"
    if hi is not None:
        return f"<= {_number(hi)}"
    return ""


def table(cls: type, prefix: str, settings: Any) -> str:
    """The reference table of the scalar keys of section dataclass ``cls`` (``prefix``: its name
    and a dot; empty at the top level)."""
    docs = field_docs(cls)
    types = typing.get_type_hints(cls)
    rows = ["| key | default | type | allowed | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        ftype = types[f.name]
        if isinstance(ftype, type) and dataclasses.is_dataclass(ftype):
            continue  # a section: a table of its own
        rows.append(f"| `{prefix}{f.name}` | `{default_text(field_default(settings, f.name))}` | "
                    f"{type_text(ftype)} | {allowed_text(f, ftype)} | "
                    f"{markdown_text(docs.get(f.name, ''))} |")
    return "\n".join(rows) + "\n"


def tables() -> dict[str, str]:
    """Every block of the reference, by name: :data:`TOP`, then each section in the order
    :class:`hvdtrain.config.Config` lists them."""
    cfg = config.Config()
    out = {TOP: table(config.Config, "", cfg)}
    types = typing.get_type_hints(config.Config)
    for f in dataclasses.fields(config.Config):
        ftype = types[f.name]
        if isinstance(ftype, type) and dataclasses.is_dataclass(ftype):
            out[f.name] = table(ftype, f"{f.name}.", getattr(cfg, f.name))
    return out


def blocks(page: str) -> dict[str, str]:
    """The marked blocks of a page, by name."""
    return {m[2]: m[3] for m in _BLOCK.finditer(page)}


def render(page: str) -> str:
    """``page`` with every marked block replaced by its generated table; :class:`ValueError` when
    a section has no block or a block names no section."""
    generated = tables()
    found = list(blocks(page))
    missing = [name for name in generated if name not in found]
    unknown = [name for name in found if name not in generated]
    if missing or unknown:
        raise ValueError(f"no block for {missing}, blocks for no section {unknown}: add or "
                         "remove <!-- reference: SECTION --> ... <!-- end reference -->")
    return _BLOCK.sub(lambda m: f"{m[1]}{generated[m[2]]}{m[4]}", page)


def write(path: Path = PAGE) -> bool:
    """Regenerates the reference in ``path``; True when the file changed."""
    old = path.read_text()
    new = render(old)
    if new != old:
        path.write_text(new)
    return new != old


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help="rewrite the reference blocks of docs/configuration.md")
    args = parser.parse_args(argv)
    if args.write:
        try:
            changed = write()
        except ValueError as err:
            raise SystemExit(f"{PAGE}: {err}") from None
        print(f"{PAGE}: {'regenerated' if changed else 'up to date'}")
        return
    for name, text in tables().items():
        sys.stdout.write(f"<!-- reference: {name} -->\n{text}<!-- end reference -->\n\n")


if __name__ == "__main__":
    main()
