"""Gradient compression: the framework-free math (:mod:`hvdtrain.compression.reference`) that the
torch and TensorFlow kernels implement and are tested against."""
