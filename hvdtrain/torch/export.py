"""The PyTorch half of ``hvdtrain export`` (:mod:`hvdtrain.export`): a checkpoint's model entries,
merged from its parts where pipeline stages wrote it, as safetensors or a transformers directory.
A checkpoint whose ranks wrote their own shards (``shard.stage`` 1-3) is exported to safetensors
one whole tensor at a time (:func:`hvdtrain.torch.shard_files.write_export`); a ring run's, and
each part of one that pipeline stages wrote, is mapped from its file (:func:`mapped_state`,
:func:`mapped_parts`) and written a tensor at a time."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hvdtrain.adapters import make_adapter
from hvdtrain.config import Config
from hvdtrain.errors import HvdtrainError
from hvdtrain.registry import MODELS
from hvdtrain.shard_files import safetensors_header
from hvdtrain.torch.models import ClassifierAdapter
from hvdtrain.torch.parts import checked_part, read_state
from hvdtrain.torch.shard_files import NAMES, sources, whole_params, write_export


def checkpoint_model(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model entries of the checkpoint at ``path`` (every part's, for one written in parts)
    mapped from their files, and its meta."""
    state = mapped_state(path)
    model, meta = dict(state["model"]), state["meta"]
    source = sources(state, path, str(path))
    if source is not None:  # written by every rank of sharded data parallel
        model.update(whole_params(source))
    elif meta.get("parts"):
        for part in mapped_parts(path.parent, meta["parts"], str(path)):
            model.update(part)
    if not model:
        raise HvdtrainError(f"export: {path} holds no model entries")
    return model, meta


def unshared(entries: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The entries with each storage once (safetensors refuses shared tensors), contiguous, and
    the names left out, each mapped to the name kept for the same tensor."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, tensor in entries.items():
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()),
               tuple(tensor.shape))
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        kept[name] = tensor.detach().contiguous()
    return kept, aliases


def write_safetensors(entries: dict[str, torch.Tensor], out: Path, meta: dict[str, Any]) -> Path:
    """``out/model.safetensors`` of ``entries``, with the run's step and the aliases as metadata:
    the header first, then each tensor's bytes in turn, so that tensors mapped from the
    checkpoint file (:func:`mapped_state`) are read one at a time and never copied whole."""
    tensors, aliases = unshared(entries)
    position = meta.get("position", {})
    header = [(name, NAMES[t.dtype], list(t.shape), t.numel() * t.element_size())
              for name, t in tensors.items()]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.safetensors"
    with path.open("wb") as fileobj:
        fileobj.write(safetensors_header(header, {
            "format": "pt", "aliases": json.dumps(aliases),
            "step": str(position.get("step", ""))}))
        for tensor in tensors.values():
            if tensor.numel():  # little-endian, C order: the checkpoint's bytes as they are
                fileobj.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return path


def mapped_state(path: Path, where: str | None = None) -> dict[str, Any]:
    """The checkpoint (or part) at ``path`` with its tensors mapped from the file (``mmap``): a
    tensor's pages are read when it is written and can be dropped after, and what is not
    written (the optimizer's state) is never read. A file ``torch.load`` cannot map (an older
    format) is read whole by :func:`hvdtrain.torch.parts.read_state`, which also gives the
    one-line error (naming ``where``, default the path) for a file that is no checkpoint."""
    where = where or str(path)
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001  (read_state names what is wrong in one line)
        return read_state(path.read_bytes(), where)
    if not (isinstance(state, dict) and {"model", "optimizer", "meta"} <= state.keys()
            and isinstance(state["meta"], dict)):
        return read_state(path.read_bytes(), where)
    return state


def mapped_parts(directory: Path, entries: Sequence[Mapping[str, Any]], where: str
                 ) -> Iterator[dict[str, torch.Tensor]]:
    """The model entries of each part that the manifest ``entries`` name, checked against its
    sha256 and mapped from its file (:func:`mapped_state`): no part is read whole, so the
    export holds one tensor's pages at a time, as for a ring run's checkpoint."""
    for entry in entries:
        path = checked_part(directory, entry, where)
        yield dict(mapped_state(path, f"part {path}")["model"])


def write_hf(cfg: Config, checkpoint: Path, entries: dict[str, torch.Tensor], out: Path) -> None:
    """A transformers directory: the run's model built as training built it, given the
    checkpoint's weights, written with ``save_pretrained``; the corpus's tokenizer beside it."""
    from hvdtrain.driver import make_dataset

    adapter = make_adapter(MODELS["torch"].get(cfg.model.name), cfg.model.options,
                           cfg.model.name, ClassifierAdapter)
    dataset = make_dataset(cfg)
    model: Any = adapter.build(dataset.spec())
    if hasattr(adapter, "model_entries"):  # pipeline stages' names -> the model's own
        entries = adapter.model_entries(model, entries)
    try:
        model.load_state_dict(entries)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise HvdtrainError(f"export: {checkpoint} does not fit the run's model: "
                            f"{first}") from None
    model.config.use_cache = True  # inference again
    model.save_pretrained(str(out))
    write_tokenizer(getattr(dataset, "tokenizer", None), out)


def write_tokenizer(tokenizer: Path | None, out: Path) -> None:
    """The corpus's tokenizer file (None: bytes, nothing to write) in the transformers directory
    ``out``: a ``tokenizer.json`` with its ``tokenizer_config.json``, so that
    ``AutoTokenizer.from_pretrained(out)`` loads it; a sentencepiece model copied as it is."""
    if tokenizer is None:
        return
    if tokenizer.suffix == ".json":
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(tokenizer_file=str(tokenizer)).save_pretrained(str(out))
    else:
        shutil.copyfile(tokenizer, out / tokenizer.name)


def export_torch(cfg: Config, checkpoint: Path, fmt: str, out: Path) -> None:
    """Writes the export of ``checkpoint`` (of a run of ``cfg``) in format ``fmt`` to ``out``."""
    if fmt == "hf":
        write_hf(cfg, checkpoint, checkpoint_model(checkpoint)[0], out)
        return
    state = mapped_state(checkpoint)
    source = sources(state, checkpoint, str(checkpoint))
    if source is not None:  # shards: streamed, never the whole model in memory
        write_export(source, out / "model.safetensors", state["meta"],
                     *unshared(dict(source["model"])))
    else:  # a ring run's tensors, or pipeline stages' parts, mapped from their files
        entries, meta = checkpoint_model(checkpoint)
        write_safetensors(entries, out, meta)
