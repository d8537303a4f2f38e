"""The TensorFlow side of hvdtrain: everything here may import tensorflow and horovod.tensorflow."""

import os

# TensorFlow's C++ start-up notices (CPU features, oneDNN) are not the user's concern.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from hvdtrain.tensorflow.models import MLP, ClassifierAdapter

__all__ = ["MLP", "ClassifierAdapter"]
