"""What both frameworks' built-in language model (``model.name: gpt``) share, framework-free: its
options, its shape for a dataset, its initialisation scheme and the metric derived from its loss.

The model itself is ``hvdtrain/torch/lm.py`` and ``hvdtrain/tensorflow/lm.py``: a GPT-style decoder
(token and position embeddings, ``layers`` pre-LayerNorm transformer blocks of causal
self-attention and an MLP, a final LayerNorm and a linear head), the same layers with the same
initial weight distributions in both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hvdtrain.configcheck import options_of
from hvdtrain.data.contracts import ArraySpec, DatasetSpec
from hvdtrain.errors import HvdtrainError

INIT_STD = 0.02
"""GPT-2's initialisation (Radford et al. 2019, as nanoGPT): every linear weight and embedding is
drawn from N(0, 0.02^2), biases are zero, LayerNorms start as the identity."""


def residual_std(layers: int) -> float:
    """The standard deviation of the projections that write into the residual stream (the
    attention's output and the MLP's second layer): ``INIT_STD / sqrt(2 * layers)``, so the
    stream's variance does not grow with the depth (GPT-2)."""
    return INIT_STD / math.sqrt(2 * layers)


def perplexity(means: Mapping[str, float]) -> float:
    """``exp(loss)``: the perplexity of a mean token cross-entropy in nats (infinite where the
    exponential overflows)."""
    loss = means["loss"]
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


DERIVED_METRICS: dict[str, Callable[[Mapping[str, float]], float]] = {"perplexity": perplexity}
"""The language models' derived metrics (:attr:`GPT.derived_metrics` in both frameworks): the loop
adds ``perplexity`` (and ``eval_perplexity``) to every record beside the averaged ``loss``."""


def _positive(name: str, value: Any, zero_ok: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero_ok else 1):
        what = "a non-negative" if zero_ok else "a positive"
        raise HvdtrainError(f"model.options.{name}={value!r}: expected {what} integer")
    return value


@dataclass(frozen=True)
class GptOptions:
    """The options of ``gpt`` (``model.options``), checked when the adapter is made."""

    layers: int = 4
    """Transformer blocks."""
    d_model: int = 128
    """Width of the residual stream (embeddings, attention); the MLP is 4 times as wide."""
    heads: int = 4
    """Attention heads; must divide ``d_model``."""
    context: int = 0
    """Positions the model has embeddings for (0: the data's sequence length)."""
    dropout: float = 0.0
    """Dropout after the embeddings, on the attention weights, and on each block's two branches."""
    vocab_size: int = 0
    """Tokens the model knows (0: the data's ``num_classes``, the corpus's vocabulary)."""

    def __post_init__(self) -> None:
        for name in ("layers", "d_model", "heads"):
            _positive(name, getattr(self, name))
        for name in ("context", "vocab_size"):
            _positive(name, getattr(self, name), zero_ok=True)
        if self.d_model % self.heads:
            raise HvdtrainError(f"model.options: heads={self.heads} must divide "
                                f"d_model={self.d_model}")
        if (isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float))
                or not 0.0 <= self.dropout < 1.0):
            raise HvdtrainError(f"model.options.dropout={self.dropout!r}: expected a number in "
                                f"[0, 1)")

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> GptOptions:
        """The options from ``model.options``; an unknown key is an error naming the known ones."""
        return options_of(cls, options, "gpt")


@dataclass(frozen=True)
class GptShape:
    """The model's sizes for one dataset."""

    vocab_size: int
    context: int
    seq_len: int


def gpt_shape(options: GptOptions, spec: DatasetSpec) -> GptShape:
    """The vocabulary, context and sequence length of ``gpt`` on data of ``spec``; raises for data
    that is not token windows with next-token targets (the ``text`` format's)."""
    window = spec.inputs
    if (not isinstance(window, ArraySpec) or len(window.shape) != 1 or window.shape[0] is None
            or not window.dtype.startswith(("int", "uint")) or spec.targets != window):
        raise HvdtrainError("model gpt needs token windows: inputs and targets each one integer "
                            f"array [seq_len] (data.name=text); the dataset gives inputs "
                            f"{spec.inputs} and targets {spec.targets}")
    seq_len = int(window.shape[0])
    vocab = options.vocab_size or spec.num_classes
    if not vocab:
        raise HvdtrainError("model gpt: the dataset gives no vocabulary size (num_classes); set "
                            "model.options.vocab_size")
    if spec.num_classes and vocab < spec.num_classes:
        raise HvdtrainError(f"model.options.vocab_size={vocab} is smaller than the data's "
                            f"vocabulary of {spec.num_classes}")
    context = options.context or seq_len
    if context < seq_len:
        raise HvdtrainError(f"model.options.context={context} is shorter than the data's "
                            f"sequences of {seq_len} tokens")
    return GptShape(vocab_size=vocab, context=context, seq_len=seq_len)
