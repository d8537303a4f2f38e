"""A tokenized text corpus on disk, read through memory maps (``data.name: text``), and
``hvdtrain data make-text``, which makes one from any text files with byte-level tokens.

A corpus is a directory of nanoGPT's shape: ``train.bin`` and ``val.bin``, each the corpus's tokens
as one flat array of unsigned integers (no header), and ``meta.json``::

    {"vocab_size": 256, "dtype": "uint8", "train_tokens": 168210, "val_tokens": 18690,
     "tokenizer": "bytes"}

``vocab_size`` and ``dtype`` (``uint8``, ``uint16`` or ``uint32``) are required; token counts,
where given, must match the files. nanoGPT's ``meta.pkl`` is never read (hvdtrain unpickles
nothing): next to nanoGPT's GPT-2 ``train.bin`` write ``{"vocab_size": 50257, "dtype": "uint16"}``.

A sample is a window of ``seq_len`` tokens and the same window shifted by one, its next tokens:
sample ``i`` is ``tokens[i*T : i*T+T]`` and ``tokens[i*T+1 : i*T+T+1]``. The windows do not
overlap, so an epoch is one pass over the corpus: the global-batch sampler gives every window once,
and each token is predicted once per epoch; the last ``(tokens - 1) mod T`` tokens, too few for a
window, are not trained on.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain.data.contracts import ArraySpec, Batch, BuiltDataset, DatasetSpec, Draw, Source
from hvdtrain.errors import HvdtrainError

SPLITS = {"train": "train.bin", "test": "val.bin"}
"""The file of each split: evaluation reads ``val.bin``."""
META = "meta.json"
DTYPES = ("uint8", "uint16", "uint32")
"""Token dtypes a corpus may use (little-endian): a byte, nanoGPT's ``uint16``, and room for
vocabularies beyond 65,536."""
BYTE_VOCAB = 256


def read_meta(root: Path) -> dict[str, Any]:
    """The checked contents of ``root/meta.json``: ``vocab_size``, ``dtype`` and any token counts."""
    path = root / META
    if not root.is_dir():
        raise HvdtrainError(f"data.options.root={str(root)!r}: no such directory (make a corpus "
                            f"with `hvdtrain data make-text FILES --out {root}`)")
    if not path.is_file():
        raise HvdtrainError(f"text corpus {root}: {META} not found (written by `hvdtrain data "
                            f"make-text`; it holds vocab_size and dtype)")
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise HvdtrainError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise HvdtrainError(f"{path}: expected a JSON object with vocab_size and dtype")
    vocab, dtype = meta.get("vocab_size"), meta.get("dtype")
    if dtype not in DTYPES:
        raise HvdtrainError(f"{path}: dtype={dtype!r}, expected one of {', '.join(DTYPES)}")
    limit = np.iinfo(dtype).max + 1
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 1 < vocab <= limit:
        raise HvdtrainError(f"{path}: vocab_size={vocab!r}, expected an integer in [2, {limit}] "
                            f"for {dtype} tokens")
    return meta


class TokenFile:
    """One split's tokens, memory-mapped read-only.

    :meth:`release` unmaps the pages this process has touched (as
    :class:`hvdtrain.data.npy.MappedArray` does), so a rank's resident memory stays bounded by a
    batch however large the corpus.
    """

    def __init__(self, path: Path, dtype: str, expected: Any) -> None:
        if not path.is_file():
            raise HvdtrainError(f"text corpus {path.parent}: {path.name} not found")
        size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
        if size % itemsize:
            raise HvdtrainError(f"{path}: {size} bytes is not a whole number of {dtype} tokens "
                                f"({META} says {dtype})")
        count = size // itemsize
        if expected is not None and expected != count:
            key = "train_tokens" if path.name == SPLITS["train"] else "val_tokens"
            raise HvdtrainError(f"{path}: holds {count} tokens, {META} says {key}={expected!r}")
        self.path, self.map = path, None
        self.tokens = np.zeros(0, dtype)
        if count:  # mmap refuses an empty file
            with path.open("rb") as f:
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.tokens = np.frombuffer(self.map, np.dtype(dtype).newbyteorder("<"), count)

    def release(self) -> None:
        """Drops this process's mappings of the file's pages (``MADV_DONTNEED``)."""
        if self.map is not None:
            self.map.madvise(mmap.MADV_DONTNEED)


class TextSource(Source):
    """The non-overlapping windows of one split: inputs and next tokens, int64 ``[seq_len]`` each.

    A batch is a copy of a few kilobytes from the page cache: it is gathered on the training
    thread (``in_memory``), where handing it over from a loader worker would cost more.
    """

    in_memory = True

    def __init__(self, tokens: TokenFile, seq_len: int, vocab_size: int) -> None:
        self.file, self.seq_len, self.vocab_size = tokens, seq_len, vocab_size
        # Whether a token can lie outside the vocabulary at all: then every batch is checked.
        self.check_range = vocab_size <= int(np.iinfo(tokens.tokens.dtype).max)
        self.windows = (len(tokens.tokens) - 1) // seq_len
        self.offsets = np.arange(seq_len + 1)

    def __len__(self) -> int:
        return self.windows

    def load(self, indices: np.ndarray, draw: Draw | None = None) -> Batch:
        indices = np.asarray(indices, np.int64)
        rows = self.file.tokens[indices[:, None] * self.seq_len + self.offsets].astype(np.int64)
        self.file.release()
        if self.check_range and rows.size and int(rows.max()) >= self.vocab_size:
            window = int(indices[np.nonzero(rows.max(axis=1) >= self.vocab_size)[0][0]])
            raise HvdtrainError(f"{self.file.path}: window {window} holds token "
                                f"{int(rows.max())}, outside the vocabulary of {self.vocab_size} "
                                f"({META})")
        return Batch(rows[:, :-1], rows[:, 1:])


class TextDataset(BuiltDataset):
    """``root/{train,val}.bin`` with ``root/meta.json`` (see the module docstring).

    Options: ``root``, the corpus directory; ``seq_len``, the tokens of a sample (default 64).
    The spec's ``num_classes`` is the vocabulary size (each next token is a class of it), which is
    where the built-in ``gpt`` takes its vocabulary from.
    """

    tokenizer: Path | None = None
    """The tokenizer file beside the ids (``meta.json``'s ``tokenizer_file``), None for bytes:
    the run's summary names it and ``hvdtrain export`` writes it beside the model."""

    def __init__(self, root: str, seq_len: int = 64) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise HvdtrainError(f"data.options.seq_len={seq_len!r}: expected a positive integer")
        base = Path(root)
        meta = read_meta(base)
        if "tokenizer_file" in meta:  # written by make-text --tokenizer (docs/huggingface.md)
            from hvdtrain.data.hf_vocab import check_tokenizer
            check_tokenizer(base, meta)
            self.tokenizer = (base / str(meta["tokenizer_file"])).resolve()
        vocab, dtype = int(meta["vocab_size"]), str(meta["dtype"])
        counts = {"train": meta.get("train_tokens"), "test": meta.get("val_tokens")}
        sources = {split: TextSource(TokenFile(base / name, dtype, counts[split]), seq_len, vocab)
                   for split, name in SPLITS.items()}
        for source in sources.values():
            if not len(source):
                raise HvdtrainError(
                    f"{source.file.path}: {len(source.file.tokens)} tokens, shorter than one "
                    f"window of seq_len + 1 = {seq_len + 1}; lower data.options.seq_len or "
                    f"give the corpus more text")
        window = ArraySpec((seq_len,), "int64")
        self._spec = DatasetSpec(inputs=window, targets=window, num_classes=vocab)
        self._train, self._test = sources["train"], sources["test"]


def make_text(sources: Sequence[str | Path], out: str | Path,
              val_fraction: float = 0.1) -> dict[str, Any]:
    """Writes a byte-level corpus of the files ``sources`` to ``out`` (which must not exist or be
    empty): their bytes in the order given, each file followed by a newline, the last
    ``val_fraction`` of them ``val.bin`` and the rest ``train.bin``, with ``meta.json``. Returns
    the meta. The same files in the same order write the same corpus."""
    if not 0.0 < val_fraction < 1.0:
        raise HvdtrainError(f"data make-text --val-fraction={val_fraction}: must be in (0, 1)")
    if not sources:
        raise HvdtrainError("data make-text: no source files given")
    root = Path(out)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise HvdtrainError(f"data make-text: {root} exists and is not an empty directory")
    parts = []
    for source in map(Path, sources):
        if not source.is_file():
            raise HvdtrainError(f"data make-text: {source} is not a file")
        parts.append(source.read_bytes().rstrip(b"\n") + b"\n")
    data = np.frombuffer(b"".join(parts), np.uint8)
    split = len(data) - round(len(data) * val_fraction)
    if split < 2 or len(data) - split < 2:
        raise HvdtrainError(f"data make-text: {len(data)} bytes of text leave a split empty at "
                            f"--val-fraction={val_fraction}; give more text")
    meta = {"vocab_size": BYTE_VOCAB, "dtype": "uint8", "train_tokens": split,
            "val_tokens": len(data) - split, "tokenizer": "bytes",
            "sources": [str(s) for s in sources]}
    root.mkdir(parents=True, exist_ok=True)
    data[:split].tofile(root / SPLITS["train"])
    data[split:].tofile(root / SPLITS["test"])
    (root / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta
