"""The byte-level corpus the language-model tests train on: this repository's README.md and
docs/*.md, made by ``make_text`` as ``hvdtrain data make-text`` does (no download)."""

from __future__ import annotations

from pathlib import Path

from hvdtrain.data.text import make_text

ROOT = Path(__file__).resolve().parents[1]
LM_CONFIGS = {"torch": ROOT / "configs" / "lm_torch.yaml",
              "tensorflow": ROOT / "configs" / "lm_tf.yaml"}


CORPUS_BYTES = 400_000
"""The corpus's size, fixed so that the tests' epochs (about 175 steps of 32 windows of 64 bytes)
do not move as the docs grow: the docs hold more than this."""


def docs_corpus(root: Path) -> Path:
    """The docs corpus in ``root`` (made once: an existing one is reused): the first
    :data:`CORPUS_BYTES` of README.md and docs/*.md, English and Markdown."""
    if not (root / "meta.json").exists():
        files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        text = b"".join(f.read_bytes() + b"\n" for f in files)
        assert len(text) > CORPUS_BYTES, "the docs are smaller than the corpus the tests expect"
        source = root.parent / f"{root.name}-source.md"
        source.write_bytes(text[:CORPUS_BYTES])
        make_text([source], root)
    return root
