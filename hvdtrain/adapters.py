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
"""

from __future__ import annotations

import abc
import inspect
from typing import Any

from hvdtrain.data import tree
from hvdtrain.data.contracts import DatasetSpec
from hvdtrain.errors import HvdtrainError


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
    classifier; raises for data that is not classification (several input arrays, no classes)."""
    if spec.num_classes is None or spec.input_shape is None:
        raise HvdtrainError(
            f"model {model} is a classifier: it needs one input array and num_classes; the dataset "
            f"gives inputs {tree.describe(spec.inputs)} and "
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
