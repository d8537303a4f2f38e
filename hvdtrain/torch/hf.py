"""Hugging Face ``transformers`` causal LMs as a built-in PyTorch adapter (``model.name:
hf_causal_lm``, docs/huggingface.md): GPT-2, Llama or Qwen2 from a config, or any causal LM from a
local ``save_pretrained`` directory, trained on token windows (``data.name: text``).

The model is the ``transformers`` module itself, so a checkpoint's ``model`` entry holds its
parameters under their Hugging Face names and ``hvdtrain export`` writes them as they are. The loss
and metrics are the built-in ``gpt``'s (:class:`hvdtrain.torch.lm.GPT`): the mean token
cross-entropy per sequence, ``perplexity`` and ``token_accuracy``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.adapters import Layer, ModelAdapter
from hvdtrain.data.contracts import ArraySpec, DatasetSpec
from hvdtrain.errors import HvdtrainError
from hvdtrain.hf import HfOptions, check_fit
from hvdtrain.lm import DERIVED_METRICS
from hvdtrain.torch.hf_layers import model_keys, model_layers, untie
from hvdtrain.torch.units import SPLIT


def _seq_len(spec: DatasetSpec) -> int:
    """The data's window length; raises for data that is not token windows."""
    window = spec.inputs
    if (not isinstance(window, ArraySpec) or len(window.shape) != 1 or window.shape[0] is None
            or not window.dtype.startswith(("int", "uint")) or spec.targets != window):
        raise HvdtrainError("model hf_causal_lm needs token windows: inputs and targets each one "
                            f"integer array [seq_len] (data.name=text); the dataset gives inputs "
                            f"{spec.inputs} and targets {spec.targets}")
    return int(window.shape[0])


def load_causal_lm(options: HfOptions, vocab_size: int | None) -> nn.Module:
    """The ``transformers`` model of ``options``: loaded from its local directory (offline), or
    new from the architecture's config with ``vocab_size`` tokens, in float32."""
    import transformers

    if options.pretrained:
        try:
            return transformers.AutoModelForCausalLM.from_pretrained(
                options.pretrained, local_files_only=True, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines() or [type(exc).__name__]
            raise HvdtrainError(f"model.options.pretrained={options.pretrained!r}: cannot load "
                                f"it: {first[0]}") from None
    keys = options.new_config()
    if vocab_size:
        keys.setdefault("vocab_size", vocab_size)
    try:
        config = transformers.AutoConfig.for_model(options.architecture, **keys)
    except (TypeError, ValueError) as exc:
        raise HvdtrainError(f"model.options.config for {options.architecture}: {exc}") from None
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def token_hits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """How many next tokens ``y`` ``[B, T]`` have the largest of the ``logits`` ``[B, T, V]``:
    ``logits.argmax(-1) == y`` counted, wherever no two logits tie for the largest (constant
    logits, an untrained zero head's, count as wrong). Two vectorized reductions (``amax``,
    ``amin``) and a gather, where torch's ``argmax`` over the vocabulary costs several times
    more on the CPU: 3.6 ms a step in docs/benchmarks.md's GPT-2 comparison."""
    target = logits.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    top = logits.amax(-1)
    return (target >= top).logical_and_(top > logits.amin(-1)).sum()


class HfCausalLM(ModelAdapter):
    """A ``transformers`` causal LM for token windows.

    Options (:class:`hvdtrain.hf.HfOptions`): ``pretrained`` (a local directory), or
    ``architecture`` (``gpt2``, ``llama``, ``qwen2``) with ``config`` (its config keys) and
    ``vocab_size`` (0: the data's); ``gradient_checkpointing``; ``untie_embeddings``.
    """

    derived_metrics: ClassVar[dict[str, Callable[..., float]]] = DERIVED_METRICS
    whole_layers: ClassVar[bool] = True
    """:meth:`layers` hands out parts of the model built whole, so ``shard.stage=3`` builds it
    whole (keeping its Hugging Face names) and then shards it."""

    def __init__(self, **options: Any) -> None:
        self.config = HfOptions.of(options)
        super().__init__(**options)

    def build(self, spec: DatasetSpec) -> nn.Module:
        seq_len = _seq_len(spec)
        model: Any = load_causal_lm(self.config, self.config.vocab_size or spec.num_classes)
        hf = model.config
        positions = getattr(hf, "max_position_embeddings", None)
        check_fit(int(hf.vocab_size), positions, spec.num_classes, seq_len)
        hf.use_cache = False  # training: no key-value cache
        if self.config.untie_embeddings:
            untie(model)
        # Its output is a ModelOutput, which stage 3's backward hook cannot see: never a unit.
        setattr(model.base_model, SPLIT, True)
        if self.config.gradient_checkpointing:  # the name transformers 5 gives it, else 4's
            getattr(model, "activation_checkpointing_enable",
                    model.gradient_checkpointing_enable)()
        return model

    def layers(self, spec: DatasetSpec) -> list[Layer]:
        """The model built whole, as its layers (:func:`hvdtrain.torch.hf_layers.model_layers`):
        the embedding, each block, the final norm with the head; its head untied
        (``untie_embeddings``)."""
        return model_layers(self.build(spec))

    def model_entries(self, model: nn.Module, entries: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's model entries under ``model``'s own keys (pipeline stages name them
        by the layer list; ``export --format hf`` renames them)."""
        return model_keys(model, entries)

    def output_loss(self, output: torch.Tensor, y: torch.Tensor, training: bool = True
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The built-in ``gpt``'s loss sum and ``token_accuracy`` of the logits ``output``
        (the latter counted by :func:`token_hits`)."""
        logits = output.float()  # under autocast the head's logits are bf16 or fp16
        steps = max(y.shape[1], 1)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                               reduction="sum") / steps
        return loss, {"token_accuracy": token_hits(logits.detach(), y) / steps}

    def loss_and_metrics(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         training: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.output_loss(model(input_ids=x).logits, y, training)
