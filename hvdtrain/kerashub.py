"""KerasHub causal LMs, framework-free: the options of ``model.name: kerashub_causal_lm`` and the
checks of a local preset directory (docs/huggingface.md).

The model itself is :class:`hvdtrain.tensorflow.kerashub.KerasHubCausalLM`. Nothing is ever
downloaded: a pretrained model is a local directory written by ``save_to_preset`` (its
``config.json``, ``metadata.json`` and ``model.weights.h5``), and a model from a config is built
with fresh weights under the run's seed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvdtrain.configcheck import options_of
from hvdtrain.errors import HvdtrainError

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "gpt2": {"num_layers": 2, "num_heads": 4, "hidden_dim": 64, "intermediate_dim": 256,
             "max_sequence_length": 1024, "dropout": 0.0},
    "llama": {"num_layers": 2, "num_query_heads": 4, "num_key_value_heads": 2, "hidden_dim": 64,
              "intermediate_dim": 256, "dropout": 0.0},
}
"""The architectures ``model.options.architecture`` may name (KerasHub's ``GPT2Backbone`` and
``LlamaBackbone``) and the small sizes a model from a config gets unless ``model.options.config``
sets them (no dropout)."""

PRESET_FILES = ("config.json", "model.weights.h5")
"""The files a preset directory must hold (as ``save_to_preset`` writes them)."""


@dataclass(frozen=True)
class KerasHubOptions:
    """The options of ``kerashub_causal_lm`` (``model.options``), checked when the adapter is
    made."""

    pretrained: str = ""
    """A local preset directory written by ``save_to_preset``; empty: a new model from a config."""
    architecture: str = "gpt2"
    """For a new model: ``gpt2`` or ``llama``."""
    config: dict[str, Any] = field(default_factory=dict)
    """For a new model: the backbone's arguments (``num_layers``, ``hidden_dim``, ...)."""
    vocab_size: int = 0
    """For a new model: tokens it knows (0: the data's ``num_classes``, the corpus's vocabulary)."""

    def __post_init__(self) -> None:
        if not isinstance(self.pretrained, str):
            raise HvdtrainError(f"model.options.pretrained={self.pretrained!r}: expected a path")
        if self.architecture not in ARCHITECTURES:
            raise HvdtrainError(f"model.options.architecture={self.architecture!r}: expected one "
                                f"of {', '.join(ARCHITECTURES)}")
        if not isinstance(self.config, dict):
            raise HvdtrainError(f"model.options.config={self.config!r}: expected a mapping of "
                                "the backbone's arguments")
        if (isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int)
                or self.vocab_size < 0):
            raise HvdtrainError(f"model.options.vocab_size={self.vocab_size!r}: expected a "
                                "non-negative integer")
        if self.pretrained and (self.config or self.vocab_size):
            raise HvdtrainError("model.options: pretrained takes its config from its preset; "
                                "drop config and vocab_size")
        if self.pretrained:
            check_preset(Path(self.pretrained))

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> KerasHubOptions:
        """The options from ``model.options``; an unknown key is an error naming the known ones."""
        return options_of(cls, options, "kerashub_causal_lm")

    def new_config(self) -> dict[str, Any]:
        """The backbone arguments of a new model: the architecture's small sizes, then
        ``config``."""
        return {**ARCHITECTURES[self.architecture], **self.config}


def check_preset(path: Path) -> None:
    """Raises one line for a directory that ``from_preset`` could not load offline."""
    if not path.is_dir():
        raise HvdtrainError(f"model.options.pretrained={str(path)!r}: no such directory (write "
                            "one with save_to_preset; nothing is downloaded)")
    for name in PRESET_FILES:
        if not (path / name).is_file():
            raise HvdtrainError(f"model.options.pretrained={str(path)!r}: {name} is missing")
