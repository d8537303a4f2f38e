"""Sharded data parallel at stages 2 and 3 as the planner prices them (docs/planner.md): the
model's units, each unit's all-gathers and reduce-scatters on one link in the order hvdtrain's
hooks start them (:mod:`hvdtrain.torch.shard_units`), and the passes that wait for them.

- Stage 2: the forward pass as the ring's; in the backward pass each unit's gradient is
  reduce-scattered when the pass has made it, at most two in flight (a third waits for the
  oldest); after the update of the rank's shards, one all-gather per unit, one after another.
- Stage 3: before each unit's forward pass its parameters are all-gathered, and the gathers of
  the next ``prefetch`` units are started (so a unit's gather runs behind the previous unit's
  compute when ``prefetch`` >= 1); with ``reshard`` the same again before each unit's backward
  pass, in reverse order; each unit's reduce-scatter as at stage 2. Parameters in no unit are
  gathered once before the forward pass and reduce-scattered at the end of the backward pass.

One link carries one collective at a time, in the order they were started (Horovod runs a rank's
collectives in its background thread in that order). Framework-free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hvdtrain.plan.profile import LayerProfile

Cost = Callable[[float], float]
"""Seconds of one collective over the unit's whole float32 bytes (a reduce-scatter of them, or
the all-gather of their shards)."""


@dataclass(frozen=True)
class ShardUnit:
    """One unit of the model: its share of the passes and its parameters' float32 bytes."""

    name: str
    forward_s: float
    backward_s: float
    bytes: float
    root: bool = False
    """The parameters in no layer (hvdtrain's last unit, gathered for the whole pass)."""


def shard_units(layers: Sequence[LayerProfile], gradient_bytes: float, forward_s: float,
                backward_s: float) -> list[ShardUnit]:
    """The units: the profile's layers in order (hvdtrain's units of a model whose layers are a
    ``Sequential``), each with its profiled share of the passes' ``forward_s`` and
    ``backward_s`` and its parameters' float32 bytes, then the gradient bytes no layer holds as
    one root unit. Without a layer list the whole model is the root unit."""
    fsum = sum(x.forward_s for x in layers)
    bsum = sum(x.backward_s for x in layers)
    out = [ShardUnit(x.name, forward_s * (x.forward_s / fsum if fsum else 1 / len(layers)),
                     backward_s * (x.backward_s / bsum if bsum else 1 / len(layers)),
                     4.0 * x.params) for x in layers]
    rest = gradient_bytes - sum(u.bytes for u in out)
    if not out:
        return [ShardUnit("model", forward_s, backward_s, float(gradient_bytes), root=True)]
    if rest > 0:
        out.append(ShardUnit("parameters in no layer", 0.0, 0.0, rest, root=True))
    return out


@dataclass
class ShardStep:
    """One step of a rank: its seconds, its time-line and the bytes it hands the collectives."""

    seconds: float = 0.0
    segments: list[tuple[str, str, float, float]] = field(default_factory=list)
    """``(lane, label, start, end)``."""
    wire_bytes: float = 0.0
    """Unit bytes reduce-scattered and all-gathered a step (the whole unit's, for each)."""
    pass_s: float = 0.0
    """One forward and backward pass with its collectives, to the last reduce-scatter's end:
    what each accumulated pass before the step's last takes (``train.backward_passes_per_step``:
    stages 2-3 reduce-scatter, and stage 3 gathers, in every pass)."""
    pass_wire: float = 0.0
    """The bytes of :attr:`pass_s`'s collectives."""


class _Run:
    """The step being built: the compute's clock, the link's, and the reduce-scatters in flight."""

    def __init__(self, step: ShardStep) -> None:
        self.step, self.t, self.link = step, 0.0, 0.0
        self.in_flight: list[float] = []

    def compute(self, label: str, seconds: float) -> None:
        if seconds > 0:
            self.step.segments.append(("compute", label, self.t, self.t + seconds))
        self.t += seconds

    def collective(self, label: str, unit: ShardUnit, seconds: float, wire: float) -> float:
        """Starts one collective now; returns when it ends (the link runs one at a time)."""
        start = max(self.t, self.link)
        self.link = start + seconds
        self.step.wire_bytes += wire
        if seconds > 0:
            self.step.segments.append(("comm", f"{label} {unit.name} ({wire / 1e6:.2f} MB)",
                                       start, self.link))
        return self.link

    def wait(self, until: float) -> None:
        self.t = max(self.t, until)

    def scatter(self, unit: ShardUnit, cost: Cost, wire: float) -> None:
        """The unit's reduce-scatter starts once the one before it has ended (at most one in
        flight, overlapping the next unit's backward pass, as ``torch/shard_units.py`` does)."""
        self.settle()
        self.in_flight.append(self.collective("reduce-scatter", unit, cost(unit.bytes), wire))

    def settle(self) -> None:
        for end in self.in_flight:
            self.wait(end)
        self.in_flight = []


def stage2_step(units: Sequence[ShardUnit], update_s: float, scatter: Cost, gather: Cost,
                scatter_ratio: float = 1.0) -> ShardStep:
    """Stage 2's step: the passes, each unit's reduce-scatter behind its backward pass, the
    update of the rank's shard (``update_s``), the units' all-gathers. ``scatter_ratio``: wire
    bytes over float32 bytes of a reduce-scatter (0.5 under ``comm.compression=fp16``)."""
    run = _Run(ShardStep())
    run.compute("forward", sum(u.forward_s for u in units))
    for unit in reversed(units):
        run.compute(f"backward {unit.name}", unit.backward_s)
        run.scatter(unit, scatter, unit.bytes * scatter_ratio)
    run.settle()
    run.step.pass_s, run.step.pass_wire = run.t, run.step.wire_bytes
    run.compute("update of this rank's shards", update_s)
    for unit in units:
        run.wait(run.collective("all-gather", unit, gather(unit.bytes), unit.bytes))
    run.step.seconds = run.t
    return run.step


def stage3_step(units: Sequence[ShardUnit], update_s: float, scatter: Cost, gather: Cost,
                prefetch: int, reshard: bool, scatter_ratio: float = 1.0) -> ShardStep:
    """Stage 3's step (the module docstring): ``prefetch`` units' gathers started ahead in each
    pass; ``reshard``: gathered again before the backward pass."""
    run = _Run(ShardStep())
    layers = [u for u in units if not u.root]
    for root in (u for u in units if u.root):  # gathered for the whole pass, before it
        run.wait(run.collective("all-gather", root, gather(root.bytes), root.bytes))
    _pass(run, layers, "forward", gather, prefetch)
    if reshard:
        _pass(run, layers[::-1], "backward", gather, prefetch, scatter, scatter_ratio)
    else:
        for unit in reversed(layers):
            run.compute(f"backward {unit.name}", unit.backward_s)
            run.scatter(unit, scatter, unit.bytes * scatter_ratio)
    for root in (u for u in units if u.root):
        run.scatter(root, scatter, root.bytes * scatter_ratio)
    run.settle()
    run.step.pass_s, run.step.pass_wire = run.t, run.step.wire_bytes
    run.compute("update of this rank's shards", update_s)
    run.step.seconds = run.t
    return run.step


def _pass(run: _Run, order: Sequence[ShardUnit], direction: str, gather: Cost, prefetch: int,
          scatter: Cost | None = None, scatter_ratio: float = 1.0) -> None:
    """One pass over ``order``: before each unit its gather (if not started yet) and the next
    ``prefetch`` units' started, then its compute; in the backward pass (``scatter``) its
    reduce-scatter after it."""
    ends: dict[int, float] = {}
    for i, unit in enumerate(order):
        for k in range(i, min(len(order), i + prefetch + 1)):
            if k not in ends:
                ends[k] = run.collective("all-gather", order[k], gather(order[k].bytes),
                                         order[k].bytes)
        run.wait(ends[i])
        run.compute(f"{direction} {unit.name}",
                    unit.forward_s if scatter is None else unit.backward_s)
        if scatter is not None:
            run.scatter(unit, scatter, unit.bytes * scatter_ratio)
