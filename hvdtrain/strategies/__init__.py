"""Strategies behind one registry: the ways of spreading a training over ranks (``ring``, ``ps``,
``pipeline``, ``shard``), each in its own module with its row of the one compatibility table
(:mod:`hvdtrain.strategies.table`). Framework-free; imports no feature package."""
