"""Random-number states of a PyTorch rank (torch's CPU and CUDA generators, NumPy, Python), for
checkpoints and elastic state. A checkpoint moves between machines: CUDA states are restored for
the GPUs both have, and a GPU checkpoint resumed on the CPU keeps only the CPU ones.

Everything is stored as tensors, lists and numbers, so ``torch.load(weights_only=True)`` reads it
back without unpickling arbitrary objects.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """This process's generator states: torch's CPU generator and, where CUDA is up, each GPU's,
    NumPy's global one, Python's."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"name": name, "keys": torch.from_numpy(np.asarray(keys, np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []}


def restore(state: dict[str, Any]) -> None:
    """Sets the generators to a state returned by :func:`capture`."""
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    np.random.set_state((numpy["name"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["gauss"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    cuda = state.get("cuda") or []  # absent in checkpoints written before CUDA states were saved
    if cuda and torch.cuda.is_available():
        for index, generator in enumerate(cuda[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(generator, index)


def fork(seed: int, rank: int, step: int) -> None:
    """Gives a rank other than 0 a stream of its own after it received rank 0's state: a checkpoint
    holds rank 0's generators only, and equal streams would give all ranks one dropout mask."""
    mixed = hash((seed, rank, step)) & 0x7FFF_FFFF
    torch.manual_seed(mixed)
    np.random.seed(mixed)
    random.seed(mixed)
