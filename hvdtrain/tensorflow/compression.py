"""Maps ``comm.compression`` to Horovod's TensorFlow compressors."""

from __future__ import annotations

import horovod.tensorflow as hvd

from hvdtrain.errors import HvdtrainError

_HOROVOD = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


def horovod_compression(name: str) -> type:
    """The Horovod compressor class for a config name."""
    if name not in _HOROVOD:
        raise HvdtrainError(f"comm.compression={name!r}: one of {', '.join(_HOROVOD)} for tensorflow")
    return _HOROVOD[name]
