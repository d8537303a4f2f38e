"""Local data read with Hugging Face ``datasets`` (``data.name: hf_dataset``, docs/huggingface.md):
JSON lines, Parquet, CSV or Arrow files, or a directory written by ``save_to_disk``.

Two uses, picked by the options:

- text (``text_column``): the column's documents, each followed by a newline, tokenized once by a
  BPE trained on them (``tokenizer: bpe``, ``vocab_size`` tokens) or a local ``tokenizer.json`` /
  sentencepiece ``.model``, into a ``text`` corpus (:mod:`hvdtrain.data.text`: memory-mapped ids,
  the tokenizer beside them) under ``cache_dir``. The first rank to get there writes it under a
  file lock; the others, and every later run with the same data and options, read it.
- classification (``label_column``): the ``feature_columns`` (numbers, or one column of
  equal-length lists of numbers) as float32 inputs and the label column as int64 classes, held in
  memory; one column of images (``datasets.Image``) gives ``[3, H, W]`` inputs in [0, 1], one of
  nested lists its own shape.

Either way the splits are :class:`~hvdtrain.data.contracts.Source` objects, so the global-batch
sampler gives every sample once an epoch and a resumed run continues exactly, as for every source.
The evaluation split is ``test_path``, else the ``test`` split of a ``save_to_disk`` dataset
dictionary, else the last ``test_fraction`` of the data.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain.data.contracts import BuiltDataset, DatasetSpec, Split, check_label_range
from hvdtrain.data.hf_text import Encoder, chunked, write_corpus
from hvdtrain.data.text import TextDataset
from hvdtrain.errors import HvdtrainError

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv",
           ".arrow": "arrow"}
"""The file formats by suffix, as ``datasets`` names its builders."""


def load_table(path: str, what: str = "data.options.path") -> Any:
    """The ``datasets.Dataset`` (or ``DatasetDict`` of a ``save_to_disk`` directory) at ``path``,
    read locally: nothing is downloaded."""
    import datasets  # type: ignore[import-untyped]

    datasets.disable_progress_bars()
    where = Path(path)
    if where.is_dir():
        if not any((where / name).is_file() for name in ("state.json", "dataset_dict.json")):
            raise HvdtrainError(f"{what}={path!r}: a directory, but not one written by "
                                "save_to_disk (no state.json or dataset_dict.json)")
        return datasets.load_from_disk(str(where))
    if not where.is_file():
        raise HvdtrainError(f"{what}={path!r}: no such file or directory")
    kind = FORMATS.get(where.suffix.lower())
    if kind is None:
        raise HvdtrainError(f"{what}={path!r}: unknown format {where.suffix!r}; expected one of "
                            f"{', '.join(FORMATS)} or a save_to_disk directory")
    try:
        if kind == "arrow":
            return datasets.Dataset.from_file(str(where))
        # keep_in_memory: no copy in ~/.cache; the files are the user's and read once a run.
        return datasets.load_dataset(kind, data_files=str(where), split="train",
                                     keep_in_memory=True)
    except Exception as exc:  # noqa: BLE001  (pyarrow's and datasets' own errors: one line)
        first = str(exc).strip().splitlines() or [type(exc).__name__]
        raise HvdtrainError(f"{what}={path!r}: not readable as {kind} ({first[0]})") from None


def _splits(path: str, test_path: str | None, test_fraction: float) -> tuple[Any, Any]:
    """The training and evaluation tables."""
    table = load_table(path)
    if hasattr(table, "keys"):  # a DatasetDict
        names = list(table.keys())
        if "train" not in names:
            raise HvdtrainError(f"data.options.path={path!r}: a dataset dictionary without a "
                                f"train split (it has {', '.join(names)})")
        train = table["train"]
        if test_path is None and "test" in names:
            return train, table["test"]
        table = train
    if test_path is not None:
        return table, load_table(test_path, "data.options.test_path")
    if not 0.0 < test_fraction < 1.0:
        raise HvdtrainError(f"data.options.test_fraction={test_fraction!r}: must be in (0, 1)")
    cut = len(table) - round(len(table) * test_fraction)
    if cut < 1 or cut >= len(table):
        raise HvdtrainError(f"data.options.path={path!r}: {len(table)} rows leave a split empty "
                            f"at test_fraction={test_fraction}")
    return table.select(range(cut)), table.select(range(cut, len(table)))


def _column(table: Any, name: str, key: str) -> Any:
    """The column ``name``; a missing one is one line naming the columns there are."""
    if name not in table.column_names:
        raise HvdtrainError(f"data.options.{key}={name!r}: no such column (the data has "
                            f"{', '.join(table.column_names)})")
    return table[name]


def _fingerprint(paths: Sequence[str | None], options: dict[str, Any]) -> str:
    """A key of the data files (path, size, modification time) and the options that shape the
    corpus: a change to either makes a new cache entry."""
    parts: list[Any] = [options]
    for path in filter(None, paths):
        files = sorted(Path(path).rglob("*")) if Path(path).is_dir() else [Path(path)]
        parts += [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns)
                  for f in files if f.is_file()]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


class HfDataset(BuiltDataset):
    """Local files read with ``datasets`` (see the module docstring).

    Options: ``path`` (a file or a save_to_disk directory), ``test_path``, ``test_fraction``
    (0.1); text: ``text_column``, ``tokenizer`` (``bpe`` or a tokenizer file), ``vocab_size``
    (1024, for ``bpe``), ``seq_len`` (64), ``cache_dir`` (default: ``.hvdtrain-cache`` beside the
    data); classification: ``label_column``, ``feature_columns``.
    """

    tokenizer: Path | None = None
    """A text corpus's tokenizer file (:attr:`hvdtrain.data.text.TextDataset.tokenizer`)."""

    def __init__(self, path: str, text_column: str | None = None, label_column: str | None = None,
                 feature_columns: Sequence[str] = (), tokenizer: str = "bpe",
                 vocab_size: int = 1024, seq_len: int = 64, test_path: str | None = None,
                 test_fraction: float = 0.1, cache_dir: str | None = None) -> None:
        if (text_column is None) == (label_column is None):
            raise HvdtrainError("data.options: give text_column (a text corpus) or label_column "
                                "(classification), one of them")
        if text_column is not None:
            self._text(path, text_column, tokenizer, vocab_size, seq_len, test_path,
                       test_fraction, cache_dir)
        else:
            self._classes(path, str(label_column), list(feature_columns), test_path,
                          test_fraction)

    def _text(self, path: str, column: str, tokenizer: str, vocab_size: int, seq_len: int,
              test_path: str | None, test_fraction: float, cache_dir: str | None) -> None:
        file = None if tokenizer == "bpe" else Path(tokenizer)
        if file is not None and not file.is_file():
            raise HvdtrainError(f"data.options.tokenizer={tokenizer!r}: no such file (give bpe, "
                                "a tokenizer.json or a sentencepiece .model)")
        key = _fingerprint([path, test_path, tokenizer if file else None],
                           {"column": column, "tokenizer": tokenizer, "vocab_size": vocab_size,
                            "test_fraction": test_fraction})
        base = Path(cache_dir) if cache_dir else Path(path).resolve().parent / ".hvdtrain-cache"
        root = base / f"text-{key}"
        base.mkdir(parents=True, exist_ok=True)
        with (base / f"text-{key}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one rank tokenizes; the others wait, then read it
            if not (root / "meta.json").is_file():
                self._tokenize(root, path, column, file, vocab_size, test_path, test_fraction)
        corpus = TextDataset(str(root), seq_len)
        self.tokenizer = corpus.tokenizer
        self._spec, self._train, self._test = corpus.spec(), corpus.train(), corpus.test()

    @staticmethod
    def _tokenize(root: Path, path: str, column: str, file: Path | None, vocab_size: int,
                  test_path: str | None, test_fraction: float) -> None:
        train, test = _splits(path, test_path, test_fraction)
        texts = [_column(train, column, "text_column"), _column(test, column, "text_column")]

        def documents(*splits: Any) -> Iterator[list[str]]:
            return chunked(f"{str(text).rstrip(chr(10))}\n" for split in splits for text in split)

        encoder = Encoder(file, lambda: documents(*texts), vocab_size or None,
                          "data.options.tokenizer")
        tmp = root.with_name(root.name + ".tmp")
        if tmp.exists():  # a run killed while writing it
            for leftover in tmp.iterdir():
                leftover.unlink()
        write_corpus(tmp, encoder, documents(texts[0]), 0.0,
                     {"tokenizer": "bpe" if file is None else str(file), "source": path,
                      "text_column": column}, file, val_chunks=documents(texts[1]))
        tmp.rename(root)

    def _classes(self, path: str, label: str, features: list[str], test_path: str | None,
                 test_fraction: float) -> None:
        if not features:
            raise HvdtrainError("data.options.feature_columns: give the input columns of "
                                "label_column's classification")
        train, test = _splits(path, test_path, test_fraction)
        num_classes = getattr(train.features.get(label), "num_classes", None)
        arrays = []
        for table in (train, test):
            arrays.append((_inputs(table, features), np.asarray(_column(table, label,
                                                                        "label_column"))))
        for _, y in arrays:
            if not np.issubdtype(y.dtype, np.integer):
                raise HvdtrainError(f"data.options.label_column={label!r}: labels must be "
                                    f"integers, the column holds {y.dtype}")
        if num_classes is None:
            num_classes = int(max(int(y.max()) for _, y in arrays if len(y))) + 1
        for (_, y), split in zip(arrays, ("train", "test"), strict=True):
            check_label_range(y, num_classes, f"{path} ({split})")
        (xtr, ytr), (xte, yte) = arrays
        if xtr.shape[1:] != xte.shape[1:]:
            raise HvdtrainError(f"data.options.feature_columns: a training sample is "
                                f"{list(xtr.shape[1:])}, an evaluation sample "
                                f"{list(xte.shape[1:])}")
        self._train = Split(xtr, ytr.astype(np.int64))
        self._test = Split(xte, yte.astype(np.int64))
        self._spec = DatasetSpec(input_shape=xtr.shape[1:], num_classes=num_classes)


def _inputs(table: Any, names: list[str]) -> np.ndarray:
    """The float32 inputs of ``names``: numbers or 1-D lists, side by side in one vector; or one
    column of images (``datasets.Image``) or of nested lists, each sample keeping its shape."""
    columns = [_column(table, name, "feature_columns") for name in names]
    if len(names) == 1 and type(table.features.get(names[0])).__name__ == "Image":
        return _images(columns[0], names[0])
    try:
        parts = [np.asarray(column, np.float32) for column in columns]
    except (TypeError, ValueError) as exc:  # lists of different lengths, strings
        first = str(exc).strip().splitlines()[0]
        raise HvdtrainError(f"data.options.feature_columns={names}: not numbers or lists of "
                            f"one length ({first})") from None
    if len(parts) == 1 and parts[0].ndim > 2:  # an image as nested lists: its shape kept
        return parts[0]
    x = np.stack(parts, axis=1)
    return x.reshape(len(x), -1)


def _images(column: Any, name: str) -> np.ndarray:
    """The images of an ``Image`` column as float32 ``[N, 3, H, W]`` in [0, 1] (RGB, channels
    first, as ``data.name: image_folder`` gives them); images of two sizes are one line."""
    arrays = [np.asarray(image.convert("RGB"), np.float32) / 255.0 for image in column]
    sizes = sorted({a.shape[:2] for a in arrays})
    if len(sizes) > 1:
        raise HvdtrainError(f"data.options.feature_columns={name!r}: images of {len(sizes)} "
                            f"sizes ({', '.join(f'{h}x{w}' for h, w in sizes[:3])}, ...); "
                            "resize them to one")
    if not arrays:
        return np.zeros((0, 3, 0, 0), np.float32)
    return np.stack(arrays).transpose(0, 3, 1, 2).copy()
