"""The torch package against hvdtrain.frameworks' protocols (mypy checks the types in
hvdtrain/torch/contract.py): every exchange factory the strategies' registry names for torch is
one the contract lists, and imports; each strategy's checkpoint layout is its engine's."""

from __future__ import annotations

from importlib import import_module

from hvdtrain.engine import PartedState
from hvdtrain.strategies.base import STAGE_PARTS
from hvdtrain.strategies.table import STRATEGIES, strategy
from hvdtrain.torch import contract


def test_every_factory_the_registry_names_is_in_the_contract():
    named = {path for name in STRATEGIES for kind in strategy(name).exchanges
             for role, path in kind.factories.items() if role.split(".")[0] == "torch"}
    found = set()
    for path in named:
        module, _, function = path.partition(":")
        found.add(getattr(import_module(module), function))
    assert found == set(contract.FACTORIES)
    assert len(named) == len(contract.FACTORIES)


def test_each_strategys_checkpoint_layout_is_its_engines():
    """A strategy whose layout is in stage parts trains with an engine that writes parts
    (:class:`hvdtrain.engine.PartedState`, which the checkpoint manager asks); every other with
    one that writes whole (its own, or the ring's)."""
    for name in STRATEGIES:
        found = strategy(name)
        path = found.engines.get("torch", strategy("ring").engines["torch"])
        module, _, cls = path.partition(":")
        parted = issubclass(getattr(import_module(module), cls), PartedState)
        assert found.checkpoint is not None
        assert parted == (found.checkpoint.files == STAGE_PARTS), name
