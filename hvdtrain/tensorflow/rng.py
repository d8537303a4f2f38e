"""Random-number states of a TensorFlow rank, as NumPy arrays for the ``.npz`` checkpoint.

A Keras 3 layer's own seed generator (Dropout's) is a model variable and travels with the model;
here are the process-wide ones: TensorFlow's global generator, Keras's global seed generator,
NumPy's and Python's.
"""

from __future__ import annotations

import random

import numpy as np
import tensorflow as tf
from keras.src.random.seed_generator import global_seed_generator


def _global_generator() -> tf.random.Generator:
    """TensorFlow's global generator. With op determinism on, TensorFlow refuses to create one
    implicitly; one seeded from Python's stream (itself seeded by the engine) is set instead."""
    try:
        return tf.random.get_global_generator()
    except RuntimeError:
        tf.random.set_global_generator(tf.random.Generator.from_seed(random.getrandbits(31)))
        return tf.random.get_global_generator()


def capture() -> dict[str, np.ndarray]:
    """This process's generator states, by name."""
    # First, since creating a global generator (on first use) draws its seed from Python's.
    frameworks = {"tf": _global_generator().state.numpy(),
                  "keras": global_seed_generator().state.numpy()}
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {**frameworks, "numpy_keys": keys,
            "numpy_rest": np.array([pos, has_gauss, gauss], np.float64),
            "python": np.array([version, *internal], np.int64),
            "python_gauss": np.array([np.nan if gauss_next is None else gauss_next], np.float64)}


def restore(state: dict[str, np.ndarray]) -> None:
    """Sets the generators to a state returned by :func:`capture`."""
    _global_generator().state.assign(state["tf"])
    global_seed_generator().state.assign(state["keras"])
    pos, has_gauss, gauss = state["numpy_rest"].tolist()
    np.random.set_state(("MT19937", state["numpy_keys"], int(pos), int(has_gauss), gauss))
    version, *internal = state["python"].tolist()
    gauss_next = float(state["python_gauss"][0])
    random.setstate((version, tuple(internal), None if np.isnan(gauss_next) else gauss_next))


def fork(seed: int, rank: int, step: int) -> None:
    """Gives a rank other than 0 a stream of its own after it received rank 0's state: a checkpoint
    holds rank 0's generators only, and equal streams would give all ranks one dropout mask."""
    mixed = hash((seed, rank, step)) & 0x7FFF_FFFF
    _global_generator().reset_from_seed(mixed)
    global_seed_generator().state.assign(np.array([mixed, 0], global_seed_generator().state.dtype))
    np.random.seed(mixed)
    random.seed(mixed)
