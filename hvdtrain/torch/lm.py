"""The built-in causal language model in PyTorch (``model.name: gpt``), a GPT-style decoder.

The model is an ordered list of layers, each a module that takes one tensor and returns one:
:class:`Embeddings` (tokens ``[B, T]`` -> hidden ``[B, T, d]``), ``layers`` x :class:`Block`
(hidden -> hidden) and :class:`Head` (hidden -> logits ``[B, T, vocab]``), so
``nn.Sequential(*layers)`` is the model and a pipeline stage can build any run of them alone
(:meth:`GPT.layers` gives one factory per layer). The head is not tied to the token embedding:
tying would put one weight on the first and the last stage. Sizes and initialisation are shared
with the Keras model (:mod:`hvdtrain.lm`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.adapters import ModelAdapter
from hvdtrain.data.contracts import DatasetSpec
from hvdtrain.lm import DERIVED_METRICS, INIT_STD, GptOptions, GptShape, gpt_shape, residual_std


def _normal(module: nn.Linear | nn.Embedding, std: float) -> None:
    """GPT-2's initialisation of one linear layer or embedding: N(0, std^2) weights, zero bias."""
    nn.init.normal_(module.weight, 0.0, std)
    bias = getattr(module, "bias", None)
    if bias is not None:
        nn.init.zeros_(bias)


class Embeddings(nn.Module):
    """Token ids ``[B, T]`` -> the sum of token and position embeddings ``[B, T, d]``."""

    def __init__(self, shape: GptShape, d_model: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(shape.vocab_size, d_model)
        self.positions = nn.Embedding(shape.context, d_model)
        self.drop = nn.Dropout(dropout)
        for embedding in (self.tokens, self.positions):
            _normal(embedding, INIT_STD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.tokens(tokens) + self.positions(positions))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attention(ln1(x))``, then ``x + mlp(ln2(x))``.

    The attention is causal (a position sees itself and the positions before it); ``qkv`` holds
    the query, key and value projections side by side, each split into ``heads`` contiguous heads.
    """

    def __init__(self, d_model: int, heads: int, dropout: float, layers: int) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)
        for linear in (self.qkv, self.fc):
            _normal(linear, INIT_STD)
        for linear in (self.proj, self.out):  # they write into the residual stream
            _normal(linear, residual_std(layers))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """Causal multi-head self-attention of ``x`` ``[B, T, d]``."""
        batch, steps, width = x.shape
        q, k, v = (part.view(batch, steps, self.heads, width // self.heads).transpose(1, 2)
                   for part in self.qkv(x).split(width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.drop(self.proj(y.transpose(1, 2).reshape(batch, steps, width)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Head(nn.Module):
    """Hidden ``[B, T, d]`` -> logits ``[B, T, vocab]``: the final LayerNorm and a linear layer
    without bias."""

    def __init__(self, shape: GptShape, d_model: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.logits = nn.Linear(d_model, shape.vocab_size, bias=False)
        _normal(self.logits, INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.ln(x))


class GPT(ModelAdapter):
    """A GPT-style causal language model for token windows (``data.name: text``).

    Options (:class:`hvdtrain.lm.GptOptions`): ``layers`` (4), ``d_model`` (128), ``heads`` (4),
    ``context`` (0: the data's ``seq_len``), ``dropout`` (0.0), ``vocab_size`` (0: the data's).
    The loss of a batch is the sum over its sequences of each sequence's mean token cross-entropy,
    so the logged ``loss`` is the mean token cross-entropy in nats and ``perplexity`` its
    exponential; ``token_accuracy`` is the share of next tokens predicted right.
    """

    derived_metrics: ClassVar[dict[str, Callable[..., float]]] = DERIVED_METRICS

    def __init__(self, **options: Any) -> None:
        self.config = GptOptions.of(options)
        super().__init__(**options)

    def layers(self, spec: DatasetSpec) -> list[Callable[[], nn.Module]]:
        """One factory per layer, in order: the embeddings, each block, the head. Each builds its
        layer alone, initialised, so a rank can build only the layers of its own stage."""
        o, shape = self.config, gpt_shape(self.config, spec)
        blocks = [functools.partial(Block, o.d_model, o.heads, o.dropout, o.layers)] * o.layers
        return [functools.partial(Embeddings, shape, o.d_model, o.dropout), *blocks,
                functools.partial(Head, shape, o.d_model)]

    def build(self, spec: DatasetSpec) -> nn.Module:
        return nn.Sequential(*(make() for make in self.layers(spec)))

    def output_loss(self, output: torch.Tensor, y: torch.Tensor, training: bool = True
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss sum and metric sums of the last layer's logits ``output`` ``[B, T, vocab]``
        against the next tokens ``y`` ``[B, T]``: per sequence, the mean over its tokens."""
        logits = output.float()  # under autocast the head's logits are bf16 or fp16
        steps = max(y.shape[1], 1)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                               reduction="sum") / steps
        right = logits.detach().argmax(dim=-1).eq_(y).sum() / steps
        return loss, {"token_accuracy": right}

    def loss_and_metrics(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         training: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.output_loss(model(x), y, training)
