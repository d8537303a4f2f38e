"""A ``transformers`` causal LM as a layer list, for pipeline stages (``pipeline.stages`` > 1,
docs/huggingface.md): the token embedding (GPT-2's with its position embedding), each decoder
block, and the final norm with the head, each a module from one tensor to one tensor.

A decoder block of ``transformers`` takes the attention mask and the positions (Llama's and
Qwen2's rotary position embeddings too) beside the hidden states; :class:`Block` makes them
inside from the hidden states alone, as the whole model makes them for a batch of full windows
(no padding mask, positions from 0), so the chained layers compute the model's logits. The
layers are the model's own modules, wrapped, so they train the model's parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hvdtrain.adapters import Layer
from hvdtrain.errors import HvdtrainError


class GPT2Embedding(nn.Module):
    """Token ids ``[B, T]`` -> GPT-2's token plus position embeddings ``[B, T, d]``."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return self.drop(self.wte(ids) + self.wpe(positions))


class TokenEmbedding(nn.Module):
    """Token ids ``[B, T]`` -> the token embeddings ``[B, T, d]`` (Llama, Qwen2)."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)


class Block(nn.Module):
    """One decoder block, hidden ``[B, T, d]`` -> hidden: the causal mask, the positions and
    (with ``rotary``) the rotary position embeddings made inside, as the whole model makes them."""

    def __init__(self, layer: nn.Module, config: Any, rotary: nn.Module | None) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary
        self._config = config  # not a module: the mask follows the model's attention kind

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self._config, inputs_embeds=hidden,
                                  attention_mask=None, cache=None, position_ids=positions)
        extra = {} if self.rotary is None else {
            "position_embeddings": self.rotary(hidden, position_ids=positions)}
        out = self.layer(hidden, attention_mask=mask, position_ids=positions, use_cache=False,
                         **extra)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    """Hidden ``[B, T, d]`` -> logits ``[B, T, vocab]``: the final norm and the head."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def tied(model: Any) -> bool:
    """Whether the model's head is its token embedding (``tie_word_embeddings``)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and head.weight is embedding.weight


def untie(model: Any) -> None:
    """Gives the head its own copy of the tied token embedding, and the config
    ``tie_word_embeddings: false`` (so ``save_pretrained`` writes both and a reload keeps them
    apart)."""
    if tied(model):
        head = model.get_output_embeddings()
        head.weight = nn.Parameter(head.weight.detach().clone())
    model.config.tie_word_embeddings = False


def model_layers(model: Any) -> list[Layer]:
    """The layers of a GPT-2, Llama or Qwen2 causal LM, wrapping its own modules in order."""
    if tied(model):
        raise HvdtrainError("model hf_causal_lm: pipeline stages need the head untied from the "
                            "token embedding (they sit on the first and the last stage); set "
                            "model.options.untie_embeddings=true")
    config = model.config
    if hasattr(model, "transformer") and hasattr(model.transformer, "wte"):  # GPT-2
        base = model.transformer
        first: nn.Module = GPT2Embedding(base.wte, base.wpe, base.drop)
        blocks, norm, rotary = base.h, base.ln_f, None
    elif hasattr(model, "model") and hasattr(model.model, "embed_tokens"):  # Llama, Qwen2
        base = model.model
        first = TokenEmbedding(base.embed_tokens)
        blocks, norm, rotary = base.layers, base.norm, base.rotary_emb
    else:
        raise HvdtrainError(f"model hf_causal_lm: pipeline stages are built for GPT-2, Llama "
                            f"and Qwen2, not {config.model_type}; set pipeline.stages=1")
    wrapped = [("embedding", first),
               *((f"block.{i}", Block(layer, config, rotary)) for i, layer in enumerate(blocks)),
               ("head", Head(norm, model.lm_head))]
    return [Layer(name, _given(module)) for name, module in wrapped]


def model_keys(model: Any, entries: dict[str, Any]) -> dict[str, Any]:
    """``entries`` (a checkpoint's model) under the model's own state-dict keys: those of a
    pipeline stages' checkpoint, named by the layer list (``"0.wte.weight"``,
    ``"1.layer.attn.c_attn.weight"``, ...), renamed; any other kept as they are."""
    if not entries or not all(key.split(".", 1)[0].isdigit() for key in entries):
        return entries
    own = {id(t): key for key, t in model.state_dict(keep_vars=True).items()}
    renamed = {}
    for index, layer in enumerate(model_layers(model)):
        for name, t in layer().state_dict(keep_vars=True).items():
            renamed[f"{index}.{name}"] = own[id(t)]
    return {renamed.get(key, key): value for key, value in entries.items()}


def _given(module: nn.Module) -> Any:
    """A factory that hands out a layer already built (from the whole model)."""
    return lambda: module
