"""hvdtrain: distributed training of PyTorch and TensorFlow models on Horovod.

The core package imports neither torch nor tensorflow; the framework engines live in
``hvdtrain.torch`` and ``hvdtrain.tensorflow`` and are imported only when a run needs them.
"""

from hvdtrain.errors import HvdtrainError

__version__ = "0.1.0"
__all__ = ["HvdtrainError", "__version__"]
