"""The byte-level corpus the language-model tests train on: this repository's README.md and
docs/*.md, made by ``make_text`` as ``hvdtrain data make-text`` does (no download)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hvdtrain.data.text import BYTE_VOCAB, SPLITS, make_text

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


def unigram_perplexity(root: Path) -> float:
    """The perplexity of the corpus ``root``'s validation split under its train split's byte
    frequencies (add-one smoothed): the best a model that ignores context can do."""
    train = np.fromfile(root / SPLITS["train"], np.uint8)
    val = np.fromfile(root / SPLITS["test"], np.uint8)
    counts = np.bincount(train, minlength=BYTE_VOCAB) + 1.0
    return float(np.exp(-np.log(counts / counts.sum())[val].mean()))


def assert_learned_context(corpus: Path, first: dict, final: dict) -> None:
    """The LM tests' bar, relative to the corpus so that it follows the docs as they change: from a
    uniform guess over 256 bytes (ln 256 = 5.5 nats) at the first record, past the bytes'
    frequencies, to a model that uses the context, a quarter below :func:`unigram_perplexity`
    (the tests' 200 steps at the configs' rate end at 0.53-0.57 of it on eight corpora cut from
    the docs of four commits, both frameworks; at twice that rate they sometimes stayed at it)."""
    context_free = unigram_perplexity(corpus)
    assert first["perplexity"] > context_free, (first, context_free)
    assert max(final["eval_perplexity"], final["train_perplexity"]) < 0.75 * context_free, \
        (final, context_free)
