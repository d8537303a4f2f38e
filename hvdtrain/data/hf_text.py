"""Text corpora tokenized by a real tokenizer (``hvdtrain data make-text --tokenizer``,
docs/huggingface.md): a byte-level BPE trained on the corpus with ``tokenizers`` at a given
vocabulary size, or a local ``tokenizer.json`` (``tokenizers``' or ``transformers``' format) or
sentencepiece ``.model``.

The corpus has the ``text`` format's shape (:mod:`hvdtrain.data.text`): ``train.bin`` and
``val.bin`` hold the token ids as one flat array (``uint16`` up to 65,536 tokens, else
``uint32``), ``meta.json`` their vocabulary and counts, and the tokenizer is saved beside them
(``tokenizer.json`` or ``tokenizer.model``), named by ``meta.json``'s ``tokenizer_file``, so that
the run that trains on the corpus (its config names the corpus) and ``hvdtrain export --format
hf`` find it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain.data.text import META, SPLITS
from hvdtrain.errors import HvdtrainError

CHUNK_LINES = 4096
"""Lines encoded in one call: ``tokenizers`` encodes a batch on all cores, and a corpus of any size
passes through in pieces of this many lines."""
MIN_BPE_VOCAB = 257
"""A byte-level BPE starts from the 256 bytes; it needs room for at least one merge."""


def _chunks(sources: Sequence[Path]) -> Iterator[list[str]]:
    """The corpus's lines, each with its newline, in lists of at most :data:`CHUNK_LINES`: every
    file's text in order, each file ending in one newline, as the byte-level ``make-text`` joins
    them. A list is sliced from a file's lines (no line at a time in Python); a piece never
    spans two files, which changes nothing, as each line is encoded on its own."""
    for source in sources:
        text = source.read_text(encoding="utf-8", errors="replace").rstrip("\n") + "\n"
        lines = text.splitlines(keepends=True)
        del text  # the lines hold the text; not a second copy of it while they are encoded
        for start in range(0, len(lines), CHUNK_LINES):
            yield lines[start:start + CHUNK_LINES]


def chunked(lines: Iterable[str]) -> Iterator[list[str]]:
    """``lines`` in lists of :data:`CHUNK_LINES`."""
    chunk: list[str] = []
    for line in lines:
        chunk.append(line)
        if len(chunk) == CHUNK_LINES:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def train_bpe(chunks: Iterable[list[str]], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (GPT-2's scheme) of at most ``vocab_size`` tokens, trained on
    the corpus's chunks of lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_BPE_VOCAB:
        raise HvdtrainError(f"data make-text --vocab-size={vocab_size!r}: a byte-level BPE needs "
                            f"at least {MIN_BPE_VOCAB} tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(chunks, trainer=trainer)
    return tokenizer


class Encoder:
    """One interface over a ``tokenizers`` tokenizer and a sentencepiece model: the file at
    ``path``, or (``path`` None) a BPE of ``vocab_size`` tokens trained on ``chunks()``."""

    def __init__(self, path: Path | None, chunks: Callable[[], Iterable[list[str]]],
                 vocab_size: int | None, what: str = "data make-text --tokenizer") -> None:
        self.sentencepiece = path is not None and path.suffix == ".model"
        if path is None:
            self.impl: Any = train_bpe(chunks(), vocab_size or 0)
        elif self.sentencepiece:
            import sentencepiece

            try:
                self.impl = sentencepiece.SentencePieceProcessor(model_file=str(path))
            except (OSError, RuntimeError) as exc:
                raise HvdtrainError(f"{what}={path}: not a sentencepiece "
                                    f"model ({exc})") from None
        else:
            from tokenizers import Tokenizer

            try:
                self.impl = Tokenizer.from_file(str(path))
            except Exception as exc:  # noqa: BLE001  (the library raises plain Exceptions)
                first = str(exc).strip().splitlines() or [type(exc).__name__]
                raise HvdtrainError(f"{what}={path}: not a tokenizer.json "
                                    f"({first[0]})") from None

    @property
    def vocab_size(self) -> int:
        if self.sentencepiece:
            return int(self.impl.get_piece_size())
        return int(self.impl.get_vocab_size(with_added_tokens=True))

    def encode(self, lines: list[str]) -> list[Any]:
        """The library's encodings of ``lines``, one a line (:meth:`ids` reads them). Both
        libraries encode a batch on their own threads, without holding the GIL."""
        if self.sentencepiece:
            return list(self.impl.encode(lines))
        return list(self.impl.encode_batch_fast(lines, add_special_tokens=False))

    def ids(self, encodings: list[Any]) -> Iterator[int]:
        """The token ids of :meth:`encode`'s ``encodings``, in order."""
        if self.sentencepiece:
            return chain.from_iterable(encodings)
        return chain.from_iterable(e.ids for e in encodings)

    def save(self, root: Path, path: Path | None) -> str:
        """Saves the tokenizer in ``root`` and returns its file name there."""
        if self.sentencepiece and path is not None:
            shutil.copyfile(path, root / "tokenizer.model")
            return "tokenizer.model"
        self.impl.save(str(root / "tokenizer.json"))
        return "tokenizer.json"


def make_tokenized_text(sources: Sequence[str | Path], out: str | Path, val_fraction: float = 0.1,
                        tokenizer: str | None = None, vocab_size: int | None = None
                        ) -> dict[str, Any]:
    """Writes a corpus of the files ``sources`` to ``out`` (which must not exist or be empty),
    tokenized by a BPE trained on them (``tokenizer`` None or ``"bpe"``, ``vocab_size`` tokens)
    or by the tokenizer file ``tokenizer``; the last ``val_fraction`` of the tokens is
    ``val.bin``. Returns the meta."""
    if not 0.0 < val_fraction < 1.0:
        raise HvdtrainError(f"data make-text --val-fraction={val_fraction}: must be in (0, 1)")
    if not sources:
        raise HvdtrainError("data make-text: no source files given")
    root, files = Path(out), [Path(s) for s in sources]
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise HvdtrainError(f"data make-text: {root} exists and is not an empty directory")
    for source in files:
        if not source.is_file():
            raise HvdtrainError(f"data make-text: {source} is not a file")
    path = None if tokenizer in (None, "bpe") else Path(str(tokenizer))
    if path is not None and not path.is_file():
        raise HvdtrainError(f"data make-text --tokenizer={tokenizer}: no such file (give bpe, a "
                            "tokenizer.json or a sentencepiece .model)")
    if path is not None and vocab_size:
        raise HvdtrainError("data make-text: --vocab-size is for --tokenizer bpe; a tokenizer "
                            "file has its own vocabulary")
    encoder = Encoder(path, lambda: _chunks(files), vocab_size)
    return write_corpus(root, encoder, _chunks(files), val_fraction,
                        {"tokenizer": "bpe" if path is None else str(path),
                         "sources": [str(s) for s in sources]}, path)


def id_dtype(vocab_size: int) -> str:
    """The ids' array type: ``uint16`` up to 65,536 tokens, else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def encode(encoder: Encoder, chunks: Iterable[list[str]]) -> list[np.ndarray]:
    """The ids of ``chunks``, an array a chunk (``uint16`` up to 65,536 ids, else ``uint32``)."""
    dtype = id_dtype(encoder.vocab_size)
    # One chunk after the other on this thread, as a user of the library would: it encodes a
    # chunk on every core already, and reading the previous chunk's ids on a thread of our own
    # beside it (as make-text did until this) made three busy threads on two cores, the likely
    # cause of its 18% more CPU time than the library's at 100 MB; the ids cost about 3% of
    # the encoding (docs/benchmarks.md, "make-text with a tokenizer").
    return [np.fromiter(encoder.ids(encoder.encode(chunk)), dtype) for chunk in chunks]


def write_span(pieces: Sequence[np.ndarray], start: int, stop: int, path: Path) -> None:
    """Writes ids ``start`` to ``stop`` of the ``pieces`` laid end to end to ``path``, a piece at
    a time (the corpus's ids are never copied into one array)."""
    with path.open("wb") as fileobj:
        offset = 0
        for piece in pieces:
            lo, hi = max(start - offset, 0), min(stop - offset, len(piece))
            if lo < hi:
                piece[lo:hi].tofile(fileobj)
            offset += len(piece)


def write_corpus(root: Path, encoder: Encoder, chunks: Iterable[list[str]], val_fraction: float,
                 info: dict[str, Any], path: Path | None = None,
                 val_chunks: Iterable[list[str]] | None = None) -> dict[str, Any]:
    """Encodes ``chunks`` and writes them to ``root`` in the ``text`` format, the last
    ``val_fraction`` of the tokens as ``val.bin`` (or, given ``val_chunks``, those), with the
    tokenizer (read from ``path``, or the one trained) and ``meta.json`` (``info`` added to it).
    Returns the meta."""
    vocab = encoder.vocab_size
    pieces = encode(encoder, chunks)
    total = sum(len(piece) for piece in pieces)
    split = total - round(total * val_fraction)
    if val_chunks is not None:
        split = total
        pieces += encode(encoder, val_chunks)
        total = sum(len(piece) for piece in pieces)
    dtype = id_dtype(vocab)
    top = max((int(piece.max()) for piece in pieces if piece.size), default=-1)
    if top >= vocab:  # added tokens beyond the reported size
        raise HvdtrainError(f"tokenizer {info.get('tokenizer')}: it gives id "
                            f"{top}, outside its vocabulary of {vocab}")
    if split < 2 or total - split < 2:
        raise HvdtrainError(f"{total} tokens of text leave a split empty at a validation "
                            f"fraction of {val_fraction}; give more text")
    root.mkdir(parents=True, exist_ok=True)
    meta = {"vocab_size": vocab, "dtype": dtype, "train_tokens": split,
            "val_tokens": total - split, **info,
            "tokenizer_file": encoder.save(root, path)}
    write_span(pieces, 0, split, root / SPLITS["train"])
    write_span(pieces, split, total, root / SPLITS["test"])
    (root / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta
