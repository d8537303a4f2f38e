"""The byte-level corpus the language-model tests train on: this repository's README.md and
docs/*.md, made by ``make_text`` as ``hvdtrain data make-text`` does (no download)."""

from __future__ import annotations

from pathlib import Path

from hvdtrain.data.text import make_text

ROOT = Path(__file__).resolve().parents[1]
LM_CONFIGS = {"torch": ROOT / "configs" / "lm_torch.yaml",
              "tensorflow": ROOT / "configs" / "lm_tf.yaml"}


def docs_corpus(root: Path) -> Path:
    """The docs corpus in ``root`` (made once: an existing one is reused); about 190 kB of
    English and Markdown, so 2,600 training windows of 64 bytes."""
    if not (root / "meta.json").exists():
        make_text([ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], root)
    return root
