"""The torch package against hvdtrain.frameworks' protocols (mypy checks the types in
hvdtrain/torch/contract.py): every exchange factory the strategies' registry names for torch is
one the contract lists, and imports."""

from __future__ import annotations

from importlib import import_module

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
