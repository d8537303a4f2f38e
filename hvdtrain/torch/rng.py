"""Random-number states of a PyTorch rank (torch, NumPy, Python), for checkpoints and elastic state.

Everything is stored as tensors, lists and numbers, so ``torch.load(weights_only=True)`` reads it
back without unpickling arbitrary objects.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """This process's generator states: torch's CPU generator, NumPy's global one, Python's."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next}}


def restore(state: dict[str, Any]) -> None:
    """Sets the generators to a state returned by :func:`capture`."""
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    np.random.set_state((numpy["name"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["gauss"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))


def fork(seed: int, rank: int, step: int) -> None:
    """Gives a rank other than 0 a stream of its own after it received rank 0's state: a checkpoint
    holds rank 0's generators only, and equal streams would give every rank the same dropout masks."""
    mixed = hash((seed, rank, step)) & 0x7FFF_FFFF
    torch.manual_seed(mixed)
    np.random.seed(mixed)
    random.seed(mixed)
