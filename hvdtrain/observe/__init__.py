"""Observability: what a run reports about itself, and where it goes.

- :mod:`~hvdtrain.observe.records`: the :class:`Sink` contract, the throttle, and the
  :class:`MetricsLogger` that every rank calls and only rank 0 writes through (``make_logger``).
- :mod:`~hvdtrain.observe.sinks`: the destinations: ``metrics.jsonl``, the console, TensorBoard,
  Weights & Biases (by name in :data:`hvdtrain.registry.SINKS`).
- :mod:`~hvdtrain.observe.writer`: the dashboards' writer process, which runs TensorBoard and W&B
  off the training process.
- :mod:`~hvdtrain.observe.system`: system samples (CPU, memory, GPU) of one rank.
- :mod:`~hvdtrain.observe.ranks`: per-rank costs through the metrics allreduce: step time split,
  bytes on the wire, stragglers (``Monitor``).
- :mod:`~hvdtrain.observe.watchdog`: the stall watchdog, which names the ranks that stopped.
- :mod:`~hvdtrain.observe.report`: ``hvdtrain report``, plots and a summary table of run
  directories.

Framework-free, like the rest of the core.
"""
