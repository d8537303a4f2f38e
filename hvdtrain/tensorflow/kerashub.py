"""KerasHub causal LMs as a built-in TensorFlow adapter (``model.name: kerashub_causal_lm``,
docs/huggingface.md): GPT-2 or Llama from a config, or any KerasHub causal LM from a local preset
directory (``save_to_preset``), trained on token windows (``data.name: text``).

The model is a functional ``keras.Model`` from token ids ``[B, T]`` to logits ``[B, T, vocab]``
around KerasHub's ``CausalLM`` task (its preprocessor left out: the ids are the corpus's), every
position attended (no padding). The loss and metrics are the built-in ``gpt``'s
(:class:`hvdtrain.tensorflow.lm.GPT`): the mean token cross-entropy per sequence, ``perplexity``
and ``token_accuracy``. ``keras_hub`` is imported only here, when such a model is built.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import keras
import tensorflow as tf
from keras import ops

from hvdtrain.adapters import ModelAdapter
from hvdtrain.data.contracts import ArraySpec, DatasetSpec
from hvdtrain.errors import HvdtrainError
from hvdtrain.hf import check_fit
from hvdtrain.kerashub import KerasHubOptions
from hvdtrain.lm import DERIVED_METRICS
from hvdtrain.tensorflow.lm import GPT

NAME = "kerashub_causal_lm"

CLASSES = {"gpt2": ("GPT2Backbone", "GPT2CausalLM"), "llama": ("LlamaBackbone", "LlamaCausalLM")}
"""KerasHub's backbone and task class of each architecture (names in ``keras_hub.models``)."""


def _seq_len(spec: DatasetSpec) -> int:
    """The data's window length; raises for data that is not token windows."""
    window = spec.inputs
    if (not isinstance(window, ArraySpec) or len(window.shape) != 1 or window.shape[0] is None
            or not window.dtype.startswith(("int", "uint")) or spec.targets != window):
        raise HvdtrainError(f"model {NAME} needs token windows: inputs and targets each one "
                            f"integer array [seq_len] (data.name=text); the dataset gives inputs "
                            f"{spec.inputs} and targets {spec.targets}")
    return int(window.shape[0])


def load_causal_lm(options: KerasHubOptions, vocab_size: int | None) -> Any:
    """KerasHub's ``CausalLM`` of ``options``, without a preprocessor: loaded from its local
    preset, or new from the architecture's backbone arguments with ``vocab_size`` tokens."""
    import keras_hub

    if options.pretrained:
        try:
            return keras_hub.models.CausalLM.from_preset(options.pretrained, preprocessor=None)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            first = str(exc).strip().splitlines() or [type(exc).__name__]
            raise HvdtrainError(f"model.options.pretrained={options.pretrained!r}: cannot load "
                                f"it: {first[0]}") from None
    backbone_name, task_name = CLASSES[options.architecture]
    args = options.new_config()
    if vocab_size:
        args.setdefault("vocabulary_size", vocab_size)
    backbone_class = getattr(keras_hub.models, backbone_name)
    # A backbone passes unknown keywords on to keras.Model, which ignores them: name them here.
    known = [name for name in inspect.signature(backbone_class.__init__).parameters
             if name not in ("self", "kwargs")]
    unknown = [name for name in args if name not in known]
    if unknown:
        raise HvdtrainError(f"model.options.config for {options.architecture}: unknown "
                            f"{', '.join(unknown)} (known: {', '.join(known)})")
    try:
        backbone = backbone_class(**args)
    except (TypeError, ValueError) as exc:
        raise HvdtrainError(f"model.options.config for {options.architecture}: {exc}") from None
    return getattr(keras_hub.models, task_name)(backbone=backbone, preprocessor=None)


def token_model(causal_lm: Any, seq_len: int) -> keras.Model:
    """Token ids ``[B, seq_len]`` -> ``causal_lm``'s logits, with no position masked."""
    tokens = keras.Input((seq_len,), dtype="int64", name="token_ids")
    mask = ops.ones_like(tokens, dtype="bool")
    logits = causal_lm({"token_ids": tokens, "padding_mask": mask})
    return keras.Model(tokens, logits, name=NAME)


class KerasHubCausalLM(ModelAdapter):
    """A KerasHub causal LM for token windows.

    Options (:class:`hvdtrain.kerashub.KerasHubOptions`): ``pretrained`` (a local preset
    directory), or ``architecture`` (``gpt2``, ``llama``) with ``config`` (the backbone's
    arguments) and ``vocab_size`` (0: the data's).
    """

    derived_metrics: ClassVar[dict[str, Callable[..., float]]] = DERIVED_METRICS

    def __init__(self, **options: Any) -> None:
        self.config = KerasHubOptions.of(options)
        self._lm = GPT()  # the built-in LM's loss and token accuracy from the logits
        super().__init__(**options)

    def build(self, spec: DatasetSpec) -> keras.Model:
        seq_len = _seq_len(spec)
        causal_lm = load_causal_lm(self.config, self.config.vocab_size or spec.num_classes)
        backbone = causal_lm.backbone
        check_fit(int(backbone.vocabulary_size), getattr(backbone, "max_sequence_length", None),
                  spec.num_classes, seq_len, NAME)
        return token_model(causal_lm, seq_len)

    def layers(self, spec: DatasetSpec) -> list[Callable[[], Any]]:
        raise HvdtrainError(f"model {NAME}: pipeline stages are not supported (a KerasHub "
                            "backbone is one functional model); set pipeline.stages=1")

    def output_loss(self, output: Any, y: tf.Tensor, training: bool = True
                    ) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
        """The built-in ``gpt``'s loss sum and ``token_accuracy`` of the logits ``output``."""
        return self._lm.output_loss(output, y, training)

    def loss_and_metrics(self, model: keras.Model, x: tf.Tensor, y: tf.Tensor,
                         training: bool = True) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
        return self.output_loss(model(x, training=training), y, training)
