"""Hugging Face models, framework-free: the options of ``model.name: hf_causal_lm`` and the checks
of a local pretrained directory (docs/huggingface.md).

The model itself is :class:`hvdtrain.torch.hf.HfCausalLM`. Nothing is ever downloaded: a
pretrained model is a local directory written by ``save_pretrained`` (``config.json`` and its
weights), and a model from a config is built with fresh weights under the run's seed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvdtrain.configcheck import options_of
from hvdtrain.errors import HvdtrainError

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
             "attn_pdrop": 0.0, "bos_token_id": None, "eos_token_id": None},
    "llama": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 256,
              "num_attention_heads": 4, "num_key_value_heads": 2},
    "qwen2": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 256,
              "num_attention_heads": 4, "num_key_value_heads": 2},
}
"""The architectures ``model.options.architecture`` may name (the ``model_type`` of their
``transformers`` config) and the small sizes a model from a config gets unless
``model.options.config`` sets them (no dropout; GPT-2's special tokens unset, as the vocabulary is
the data's)."""

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
"""The files of which a pretrained directory must hold one (as ``save_pretrained`` writes them)."""


@dataclass(frozen=True)
class HfOptions:
    """The options of ``hf_causal_lm`` (``model.options``), checked when the adapter is made."""

    pretrained: str = ""
    """A local directory written by ``save_pretrained``; empty: a new model from a config."""
    architecture: str = "gpt2"
    """For a new model: ``gpt2``, ``llama`` or ``qwen2``."""
    config: dict[str, Any] = field(default_factory=dict)
    """For a new model: the architecture's config keys (``n_layer``, ``hidden_size``, ...)."""
    vocab_size: int = 0
    """For a new model: tokens it knows (0: the data's ``num_classes``, the corpus's vocabulary)."""
    gradient_checkpointing: bool = False
    """Recompute each block's activations in the backward pass (``transformers``' own activation
    checkpointing): less memory, about a third more compute."""

    untie_embeddings: bool = False
    """Give the head its own copy of a tied token embedding (``tie_word_embeddings: false``):
    pipeline stages need it, as the embedding and the head sit on different stages."""

    def __post_init__(self) -> None:
        if not isinstance(self.pretrained, str):
            raise HvdtrainError(f"model.options.pretrained={self.pretrained!r}: expected a path")
        if self.architecture not in ARCHITECTURES:
            raise HvdtrainError(f"model.options.architecture={self.architecture!r}: expected one "
                                f"of {', '.join(ARCHITECTURES)}")
        if not isinstance(self.config, dict):
            raise HvdtrainError(f"model.options.config={self.config!r}: expected a mapping of "
                                "the architecture's config keys")
        if (isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int)
                or self.vocab_size < 0):
            raise HvdtrainError(f"model.options.vocab_size={self.vocab_size!r}: expected a "
                                "non-negative integer")
        for key in ("gradient_checkpointing", "untie_embeddings"):
            if not isinstance(getattr(self, key), bool):
                raise HvdtrainError(f"model.options.{key}={getattr(self, key)!r}: expected "
                                    "true or false")
        if self.pretrained and (self.config or self.vocab_size):
            raise HvdtrainError("model.options: pretrained takes its config from its directory; "
                                "drop config and vocab_size")
        if self.pretrained:
            check_pretrained(Path(self.pretrained))

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> HfOptions:
        """The options from ``model.options``; an unknown key is an error naming the known ones."""
        return options_of(cls, options, "hf_causal_lm")

    def new_config(self) -> dict[str, Any]:
        """The config keys of a new model: the architecture's small sizes, then ``config``."""
        return {**ARCHITECTURES[self.architecture], **self.config}


def check_pretrained(path: Path) -> None:
    """Raises one line for a directory that ``from_pretrained`` could not load offline."""
    if not path.is_dir():
        raise HvdtrainError(f"model.options.pretrained={str(path)!r}: no such directory (write "
                            "one with save_pretrained; nothing is downloaded)")
    if not (path / "config.json").is_file():
        raise HvdtrainError(f"model.options.pretrained={str(path)!r}: config.json is missing")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise HvdtrainError(f"model.options.pretrained={str(path)!r}: no weights (expected one "
                            f"of {', '.join(WEIGHT_FILES)})")


def check_fit(vocab: int, positions: int | None, num_classes: int | None, seq_len: int,
              model: str = "hf_causal_lm") -> None:
    """Raises one line where a model's vocabulary or context is too small for the data."""
    if num_classes and vocab < num_classes:
        raise HvdtrainError(f"model {model}: its vocabulary of {vocab} tokens is smaller "
                            f"than the data's {num_classes} (the corpus was tokenized for "
                            "another model)")
    if positions is not None and positions < seq_len:
        raise HvdtrainError(f"model {model}: {positions} positions, fewer than the data's "
                            f"seq_len={seq_len}")
