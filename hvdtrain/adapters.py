"""The framework-free contract of a model adapter.

An adapter builds the model for a dataset and computes, for one batch, the *summed* loss and the
summed metrics (for example the number of correct predictions). Sums, not means, so that the loop
can weight ranks by how many samples each saw and average exactly across ranks and batches: the loop
divides them by the samples, so a loss summed over a sequence's tokens is logged per sequence.

A batch reaches ``loss_and_metrics`` as the dataset's source made it, arrays turned into tensors:
inputs ``x`` and targets ``y`` are tensors, or tuples, lists and dicts of them (the batch dimension
first), and ``y`` is None for data without targets (see :mod:`hvdtrain.data.contracts`).

``hvdtrain.torch.models.ClassifierAdapter`` and ``hvdtrain.tensorflow.models.ClassifierAdapter``
implement the loss and metrics for classification; a user's classifier usually overrides ``build``
only. For any other task, subclass :class:`ModelAdapter` and write both methods.

Pipeline stages (``pipeline.stages`` > 1, docs/pipeline.md) need the model as an ordered list of
layers, so that each rank builds only its own: :meth:`ModelAdapter.layers` returns zero-argument
factories, one a layer, whose outputs chained in order are the model (each layer takes one tensor
and returns one tensor; the first takes the batch's inputs), and :meth:`ModelAdapter.output_loss`
scores the last layer's output against the targets. By default :meth:`~ModelAdapter.layers`
takes the layers of a ``torch.nn.Sequential`` or ``keras.Sequential`` that ``build`` returns (that
builds the whole model on every rank: fine for a model that fits one rank; a model that does not
lists factories that build one layer each, as the built-in ``mlp`` does).
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdtrain.data import tree
from hvdtrain.data.contracts import ArraySpec, DatasetSpec
from hvdtrain.errors import HvdtrainError


@dataclass(frozen=True)
class Layer:
    """A named layer factory, for :meth:`ModelAdapter.layers` (a bare callable works too): the
    name is what ``pipeline.split`` may give where a stage begins."""

    name: str
    build: Callable[[], Any]
    """Makes the layer (a ``torch.nn.Module`` or a Keras layer), with fresh parameters."""

    def __call__(self) -> Any:
        return self.build()


def sequential_layers(model: Any) -> list[Layer] | None:
    """The layers of a ``torch.nn.Sequential`` or ``keras.Sequential`` as factories of the
    already-built layers (named as the model names them), or None for any other model. Told
    apart by class name and module: the core imports no framework."""
    cls = type(model)
    if cls.__name__ != "Sequential":
        return None
    if cls.__module__.startswith("torch."):
        return [Layer(name, _built(m)) for name, m in model.named_children()]
    if "keras" in cls.__module__:
        return [Layer(m.name, _built(m)) for m in model.layers]
    return None


def _built(layer: Any) -> Callable[[], Any]:
    """A factory that hands out a layer already built."""
    return lambda: layer


class ModelAdapter(abc.ABC):
    """Builds a model and scores batches; the config's ``model.options`` arrive as ``options``."""

    def __init__(self, **options: Any) -> None:
        self.options = options

    @abc.abstractmethod
    def build(self, spec: DatasetSpec) -> Any:
        """A new model (``torch.nn.Module`` or ``keras.Model``) for data described by ``spec``."""

    @abc.abstractmethod
    def loss_and_metrics(self, model: Any, x: Any, y: Any,
                         training: bool = True) -> tuple[Any, dict[str, Any]]:
        """Returns ``(loss_sum, {metric_name: metric_sum})`` over the samples of one batch of inputs
        ``x`` and targets ``y`` (trees of tensors, ``y`` None without targets). The batch may be
        empty (an epoch's short last step can leave a rank no samples): the sums are then zero.

        ``training`` is False during evaluation (Keras layers such as dropout need it; a torch model
        is also switched by ``model.train()``/``model.eval()``).
        """

    def layers(self, spec: DatasetSpec) -> Sequence[Callable[[], Any]] | None:
        """The model as an ordered list of layer factories for pipeline stages, or None when it
        cannot be split (the default for a model that is not a ``Sequential``).

        Each factory makes one layer with fresh parameters when called (a :class:`Layer` carries
        a name for ``pipeline.split``); the layers chained in order are the model that
        :meth:`build` returns, each taking one tensor and returning one, the first taking the
        batch's inputs ``x``. A rank calls the factories in order under the run's seed and keeps
        its own stage's layers, so that they start from the values the whole model would have;
        it never holds another stage's layer beyond that call. Calling them in order should
        therefore consume the random generator as :meth:`build` does: let :meth:`build` chain the
        same factories. By default, the layers of the ``Sequential`` that :meth:`build` returns.
        """
        return sequential_layers(self.build(spec))

    def output_loss(self, output: Any, y: Any, training: bool = True) -> tuple[Any, dict[str, Any]]:
        """Returns ``(loss_sum, {metric_name: metric_sum})`` from the last layer's ``output`` and
        the targets ``y``, as :meth:`loss_and_metrics` does from a whole model's output: what the
        last pipeline stage computes. Classifier adapters implement it (cross-entropy from
        logits); another adapter writes it to train with pipeline stages."""
        raise HvdtrainError(f"model adapter {type(self).__name__} has no output_loss(output, y, "
                            "training): pipeline stages need one (see hvdtrain.adapters)")


def make_adapter(obj: Any, options: dict[str, Any], name: str,
                 default: type) -> ModelAdapter:
    """An adapter from a registry entry or import path.

    ``obj`` is either a :class:`ModelAdapter` subclass, instantiated with ``options``, or a plain
    function ``build(spec, **options)`` returning a model, which gets the framework's ``default``
    adapter (classification) around it. ``default`` is a :class:`ModelAdapter` subclass whose
    ``build`` is left abstract (hence ``type``: mypy takes ``type[ModelAdapter]`` for a concrete
    class): the function becomes its ``build``.
    """
    try:
        if isinstance(obj, type) and issubclass(obj, ModelAdapter):
            return obj(**options)
        if callable(obj):
            inspect.signature(obj).bind(None, **options)  # the spec, then the options
            wrapped = type(f"{default.__name__}For_{getattr(obj, '__name__', 'model')}", (default,),
                           {"build": lambda self, spec: obj(spec, **self.options)})
            return wrapped(**options)
    except TypeError as exc:
        raise HvdtrainError(f"model.options for {name!r}: {exc}") from None
    raise HvdtrainError(f"model.name={name!r} is neither a ModelAdapter subclass nor a model "
                        "factory")


def classes_and_shape(spec: DatasetSpec, model: str) -> tuple[int, tuple[int, ...]]:
    """The number of classes and the input shape of a classification dataset, for a built-in
    classifier; raises for data that is not classification (several input arrays, inputs that are
    not real numbers such as token ids, no classes)."""
    floating = isinstance(spec.inputs, ArraySpec) and np.dtype(spec.inputs.dtype).kind == "f"
    if spec.num_classes is None or spec.input_shape is None or not floating:
        raise HvdtrainError(
            f"model {model} is a classifier: it needs one float input array and num_classes; the "
            f"dataset gives inputs {tree.describe(spec.inputs)} and "
            f"{'no num_classes' if spec.num_classes is None else f'{spec.num_classes} classes'} "
            f"(write a ModelAdapter for this data)")
    return spec.num_classes, tuple(int(d) for d in spec.input_shape)


def mlp_hidden(hidden: Any, unknown: dict[str, Any]) -> list[int]:
    """Checks the options of the built-in ``mlp`` (the same in both frameworks)."""
    if unknown:
        raise HvdtrainError(f"model.options: unknown option(s) for mlp: {', '.join(unknown)}")
    if (not isinstance(hidden, (list, tuple)) or not hidden
            or not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in hidden)):
        raise HvdtrainError(f"model.options.hidden={hidden!r}: "
                            "expected a list of positive integers")
    return list(hidden)
