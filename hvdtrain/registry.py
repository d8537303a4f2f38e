"""Name -> object registries for plug-ins (datasets, models per framework, metric sinks).

An entry is the object itself or a lazy ``"package.module:Name"`` string, so the core can list
and validate the names of framework models without importing torch or tensorflow. Any name that
contains ``:`` is taken as an import path, which is how a user's own model or dataset plugs in.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

from hvdtrain.errors import HvdtrainError


def import_object(path: str) -> Any:
    """Imports ``package.module:Name`` (the attribute may be dotted: ``module:Outer.Inner``)."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise HvdtrainError(f"import path {path!r}: expected package.module:Name")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise HvdtrainError(f"import path {path!r}: cannot import {module_name!r} "
                            f"({exc})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise HvdtrainError(f"import path {path!r}: {module_name!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


class Registry:
    """A named set of plug-ins that rejects duplicates and lists the known names on a miss."""

    def __init__(self, kind: str, entries: dict[str, Any] | None = None) -> None:
        self.kind = kind
        self._entries: dict[str, Any] = {}
        for name, obj in (entries or {}).items():
            self.register(name, obj)

    def register(self, name: str, obj: Any = None) -> Any:
        """Adds ``obj`` under ``name``; without ``obj`` it returns a decorator."""
        if obj is None:
            return lambda target: self.register(name, target)
        if name in self._entries:
            raise HvdtrainError(f"{self.kind} {name!r} is already registered")
        if ":" in name:
            raise HvdtrainError(f"{self.kind} name {name!r}: ':' is reserved for import paths")
        self._entries[name] = obj
        return obj

    def get(self, name: str) -> Any:
        """The object for a registered name or an import path."""
        if ":" in name:
            return import_object(name)
        if name not in self._entries:
            raise HvdtrainError(f"unknown {self.kind} {name!r}; known: {', '.join(self)} "
                                "(or give an import path package.module:Name)")
        entry = self._entries[name]
        return import_object(entry) if isinstance(entry, str) else entry

    def check(self, name: str) -> None:
        """Raises for an unknown name, importing nothing (import paths are checked later)."""
        if ":" not in name and name not in self._entries:
            self.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __contains__(self, name: str) -> bool:
        return name in self._entries


DATASETS = Registry("dataset", {"digits": "hvdtrain.data.digits:DigitsDataset",
                                "npy": "hvdtrain.data.npy:NpyDataset",
                                "image_folder": "hvdtrain.data.image_folder:ImageFolder",
                                "torch_dataset": "hvdtrain.torch.data:TorchDatasets",
                                "synthetic_images": "hvdtrain.data.synthetic:SyntheticImages",
                                "mnist1d": "hvdtrain.data.mnist1d:Mnist1dDataset",
                                "text": "hvdtrain.data.text:TextDataset",
                                "hf_dataset": "hvdtrain.data.hf_dataset:HfDataset"})
"""Framework-free datasets: each yields NumPy arrays."""

MODELS = {
    "torch": Registry("torch model", {"mlp": "hvdtrain.torch.models:MLP",
                                     "resnet18": "hvdtrain.torch.models:ResNet18",
                                     "gpt": "hvdtrain.torch.lm:GPT",
                                     "hf_causal_lm": "hvdtrain.torch.hf:HfCausalLM"}),
    "tensorflow": Registry("tensorflow model", {"mlp": "hvdtrain.tensorflow.models:MLP",
                                               "resnet18": "hvdtrain.tensorflow.models:ResNet18",
                                               "gpt": "hvdtrain.tensorflow.lm:GPT",
                                               "kerashub_causal_lm":
                                               "hvdtrain.tensorflow.kerashub:KerasHubCausalLM"}),
}
"""Model adapters per framework."""

SINKS = Registry("sink", {"jsonl": "hvdtrain.observe.sinks:JsonlSink",
                          "console": "hvdtrain.observe.sinks:ConsoleSink",
                          "tensorboard": "hvdtrain.observe.sinks:TensorBoardSink",
                          "wandb": "hvdtrain.observe.sinks:WandbSink"})
"""Metric sinks (:class:`hvdtrain.observe.records.Sink`), built by name by
:func:`hvdtrain.observe.records.make_logger` and in the dashboards' writer process; an import path
``package.module:Class`` names any other sink."""
