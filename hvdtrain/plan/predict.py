"""Every setting the planner prices, and its step time, samples/s and scaling efficiency on 1 to
the cluster's nodes (:func:`plan`). A setting the model or the cluster cannot use is kept, with
the reason, so that the table says why it is missing.

Scaling efficiency is the samples/s of ``n`` ranks over ``n`` times one rank's without any
communication (the profile's forward, backward and update), as the Horovod paper measures it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any

from hvdtrain.config import CommConfig
from hvdtrain.errors import ConfigError
from hvdtrain.layout import Layout
from hvdtrain.pipeline.schedules import SCHEDULES, check_pipeline, microbatch_count
from hvdtrain.plan import costs
from hvdtrain.plan.cluster import Cluster, Link
from hvdtrain.plan.fusion import DEFAULT_CYCLE_MS, FUSION_THRESHOLD, fuse, overlapped_end
from hvdtrain.plan.memory import ADAM_STATE, GIB, Memory, activation_bytes, misfit, model_bytes
from hvdtrain.plan.profile import RATIO_KEYS, MethodProfile, ModelProfile
from hvdtrain.plan.shard_step import ShardStep, ShardUnit, shard_units, stage2_step, stage3_step
from hvdtrain.plan.stages import (
    DEFAULT_VIRTUAL,
    PLANNED_SCHEDULES,
    PipelineStep,
    pipeline_step,
    split_layers,
)
from hvdtrain.ps.layout import ChunkLayout, server_chunk
from hvdtrain.strategies.pipeline import schedule_refused
from hvdtrain.strategies.table import strategy

OVERLAPPED = ("none", "fp16")
"""Methods of the dense exchange: Horovod's allreduce in backward hooks, overlapped."""


@dataclass(frozen=True)
class Knobs:
    """What the run config sets that the prediction depends on."""

    batch_size: int
    """``data.batch_size`` as training reads it: a rank's batch of one backward pass, and with
    pipeline stages a pipeline copy's batch (split into its micro-batches)."""
    cycle_ms: float = 0.0
    """``comm.cycle_time_ms`` (0: Horovod's 1 ms)."""
    microbatches: int = 0
    """``pipeline.microbatches`` as configured (0: ``P x v``, resolved per setting by training's
    :func:`hvdtrain.pipeline.schedules.microbatch_count`)."""
    virtual_stages: int = 0
    """``pipeline.virtual_stages`` of interleaved 1F1B (0 or 1: :data:`DEFAULT_VIRTUAL`)."""
    accumulation: int = 1
    """``train.backward_passes_per_step``: backward passes a rank accumulates before each
    exchange (:attr:`hvdtrain.world.World.accumulation`); pipelines take 1 (training refuses more)."""
    stages: int = 1
    """``pipeline.stages`` of the config: its settings without stages say ``pipeline.stages=1``."""
    servers: int = 0
    """``ps.servers`` of a config with dedicated servers (0: one server a server node)."""
    comm: dict[str, float] = field(default_factory=dict)
    """The config's ``comm`` keys of :data:`~hvdtrain.plan.profile.RATIO_KEYS` (empty without a
    config): a method whose ratio the profile measured at other values is not priced."""
    fusion_threshold: int = FUSION_THRESHOLD
    chunk_kib: int = 4096
    """``ps.chunk_kib``: the most a dedicated server's chunk holds."""
    ps_overlap: bool = True
    """``ps.overlap``: a PyTorch worker pushes each chunk as the backward pass produces it."""
    dense_share: float = CommConfig().dense_fraction
    """The share of the run's steps a compressing method averages dense before it starts
    (``comm.dense_steps``, by default ``comm.dense_fraction`` of the run, at least
    ``comm.dense_min_steps``:
    :func:`hvdtrain.plan.command.dense_share`):
    its rows price the run's mean step and bytes, the dense steps included."""
    compression: str = "none"
    """``comm.compression`` of the config: the shard stages' reduce-scatters carry 2 bytes an
    element under ``fp16`` (their rows keep the config's method)."""
    state_bytes: float = ADAM_STATE
    """The optimizer state's float32 bytes a parameter (:func:`~hvdtrain.plan.memory.state_bytes`
    of ``optim.name`` and ``optim.momentum``; Adam's 8 without a config)."""
    prefetch: int = 1
    """``shard.prefetch``: units ahead whose all-gather starts while a unit computes (stage 3)."""
    reshard: bool = True
    """``shard.reshard_after_forward``: stage 3 gathers again before the backward pass."""
    shard_stage: int = 0
    """``shard.stage`` of the config: its pipeline settings shard each stage's copies (stage 1)."""
    shard_group: str = "all"
    """``shard.group`` of the config: the plan prices ``all`` (every data-parallel rank)."""


@dataclass(frozen=True)
class Segment:
    """One bar of the step's time-line: lane, label, start and end (seconds from step start)."""

    lane: str
    label: str
    start_s: float
    end_s: float


@dataclass
class Point:
    """One setting at one node count; ``reason`` says why it cannot run there (then no times)."""

    nodes: int
    ranks: int
    step_s: float | None = None
    samples_per_s: float | None = None
    efficiency: float | None = None
    comm_s: float | None = None
    """Communication the step waits for beyond its compute."""
    batch: int | None = None
    """Samples a step takes over every rank (the global batch): ``data.batch_size`` x ranks x
    accumulated passes, with stages ``data.batch_size`` x copies."""
    memory_gib: float | None = None
    """A rank's memory (:mod:`hvdtrain.plan.memory`), where the plan knows it."""
    reason: str | None = None


@dataclass
class Prediction:
    """One setting on every node count."""

    setting: str
    how: str
    """The config overrides (or environment) that run it, or why hvdtrain cannot yet."""
    points: list[Point] = field(default_factory=list)
    reason: str | None = None
    """Why the setting does not apply at all (then ``points`` is empty)."""
    timeline: list[Segment] = field(default_factory=list)
    """One step at the largest node count where it runs."""
    microbatches: int | None = None
    """A pipeline's micro-batches a step, as training resolves ``pipeline.microbatches``."""
    wire_bytes: float | None = None
    """Shard stages 2-3: the float32 bytes a rank hands its reduce-scatters and all-gathers a
    step (the whole unit's for each), as the ``wire_bytes`` hvdtrain counts (docs/sharding.md).
    Compressing methods: a rank's bytes per step averaged over the run, its dense start included
    (:func:`run_wire_bytes`)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The dotted settings of ``how`` (``{"pipeline.stages": 2, ...}``): what the plan asks
    training's compatibility table about (empty: a setting hvdtrain does not run)."""

    @property
    def best(self) -> Point | None:
        """The point at the most nodes where the setting runs."""
        ok = [p for p in self.points if p.reason is None]
        return ok[-1] if ok else None


@dataclass
class Plan:
    """The plan: inputs echoed and every setting's prediction, best first."""

    model: str
    cluster: Cluster
    knobs: Knobs
    base_samples_per_s: float
    predictions: list[Prediction]
    configured: str = ""
    """The setting the run config asks for (marked in the table), when a config was given."""


Refuse = Callable[[Mapping[str, Any]], "str | None"]
"""Training's reason a config changed by a setting's ``settings`` cannot run, or None
(:func:`hvdtrain.plan.command.refuser`: the compatibility table, :mod:`hvdtrain.strategies`)."""

Outcome = tuple[float, list[Segment]] | str
"""A step's seconds and time-line, or the reason it cannot run."""


@dataclass(frozen=True)
class _Ctx:
    profile: ModelProfile
    cluster: Cluster
    knobs: Knobs
    refuse: Refuse | None = None

    def refused(self, settings: Mapping[str, Any]) -> str:
        """Training's reason that ``settings`` cannot run ("" when it can, or without a config)."""
        return (self.refuse(settings) or "") if self.refuse and settings else ""

    @property
    def tscale(self) -> float:
        """Profile seconds -> this cluster's seconds at this batch size."""
        return self.knobs.batch_size / self.profile.batch_size / self.cluster.compute_speed

    @property
    def fwd(self) -> float:
        return self.profile.forward_s * self.tscale

    @property
    def bwd(self) -> float:
        return self.profile.backward_s * self.tscale

    @property
    def upd(self) -> float:
        return self.profile.update_s / self.cluster.compute_speed

    @property
    def compute(self) -> float:
        return self.fwd + self.bwd + self.upd

    @property
    def lead(self) -> float:
        """The passes a rank accumulates before the step's last (compute only, no exchange)."""
        return (self.knobs.accumulation - 1) * (self.fwd + self.bwd)

    @property
    def cycle_s(self) -> float:
        return (self.knobs.cycle_ms or DEFAULT_CYCLE_MS) / 1000

    def link_between(self, nodes: int) -> Link:
        """The link a ring over every rank is limited by (within a node, or between nodes)."""
        return self.cluster.intra if nodes == 1 else self.cluster.inter


def _point(ctx: _Ctx, nodes: int, ranks: int, step: float, samples: int, passes: int) -> Point:
    """A step of ``samples`` over ``ranks``; ``passes`` backward passes a rank runs on its
    ``data.batch_size`` (1 for a pipeline copy's batch) for one rank alone's rate."""
    alone = (passes - 1) * (ctx.fwd + ctx.bwd) + ctx.compute
    base = passes * ctx.knobs.batch_size / alone
    rate = samples / step
    return Point(nodes, ranks, step, rate, rate / (ranks * base), max(0.0, step - alone),
                 batch=samples)


def _dense(ctx: _Ctx, nodes: int, cost: Callable[[float], float], ratio: float = 1.0,
           kernel_s: float = 0.0) -> tuple[float, list[Segment]]:
    """A step whose buckets overlap the backward pass (Horovod's allreduce in backward hooks)."""
    buckets = fuse(ctx.profile.tensors, lambda b: cost(b / ratio) + kernel_s * b /
                   max(1, ctx.profile.gradient_bytes), ctx.cycle_s, ctx.knobs.fusion_threshold,
                   ctx.tscale)
    end = overlapped_end(buckets, ctx.bwd)
    f = ctx.fwd
    segs = [Segment("compute", "forward", 0.0, f), Segment("compute", "backward", f, f + ctx.bwd)]
    segs += [Segment("comm", f"bucket {i} ({b.bytes / 1e6:.2f} MB, {len(b.tensors)} tensors)",
                     f + b.start_s, f + b.end_s) for i, b in enumerate(buckets) if b.end_s > b.start_s]
    segs.append(Segment("compute", "update", f + end, f + end + ctx.upd))
    return f + end + ctx.upd, segs


def _after(ctx: _Ctx, comm_s: float, kernel_s: float, label: str) -> tuple[float, list[Segment]]:
    """A step whose exchange runs after the backward pass (compressing methods, hvdtrain's ps
    under TensorFlow or ``ps.overlap=false``)."""
    f, b = ctx.fwd, ctx.fwd + ctx.bwd
    segs = [Segment("compute", "forward", 0.0, f), Segment("compute", "backward", f, b)]
    if kernel_s:
        segs.append(Segment("compute", "compression kernels", b, b + kernel_s))
    segs.append(Segment("comm", label, b + kernel_s, b + kernel_s + comm_s))
    end = b + kernel_s + comm_s
    segs.append(Segment("compute", "update", end, end + ctx.upd))
    return end + ctx.upd, segs


def _sweep(ctx: _Ctx, pred: Prediction, step: Callable[[int], Outcome],
           stages: int = 1, memory: Callable[[int], Memory | None] | None = None) -> Prediction:
    """Fills ``pred.points`` for 1 to the cluster's nodes; ``step`` returns a reason to skip.
    Without stages each rank runs ``train.backward_passes_per_step`` passes, the exchange in the
    last (``step`` prices that one); with them a copy of ``stages`` ranks takes one batch.
    ``memory``: a rank's memory at a node count (None: unknown); where it exceeds the cluster's
    ``memory_gib`` the point does not run, with the figure as the reason."""
    g = ctx.cluster.ranks_per_node
    passes = ctx.knobs.accumulation if stages == 1 else 1
    for nodes in range(1, ctx.cluster.nodes + 1):
        mem = memory(nodes) if memory is not None and ctx.profile.layers else None
        gib = mem.total / GIB if mem is not None else None
        got = step(nodes)
        if not isinstance(got, str):
            got = misfit(mem, ctx.cluster.memory_gib) or got
        if isinstance(got, str):
            pred.points.append(Point(nodes, nodes * g, memory_gib=gib, reason=got))
            continue
        seconds, segs = got
        lead = (passes - 1) * (ctx.fwd + ctx.bwd)
        if lead:
            segs = [Segment("compute", f"{passes - 1} accumulated pass(es)", 0.0, lead),
                    *(Segment(s.lane, s.label, s.start_s + lead, s.end_s + lead) for s in segs)]
        # The global batch as training's sampler counts it (ShardedSampler.step_samples over the
        # data-parallel ranks: every rank, or a pipeline's copies).
        samples = ctx.knobs.batch_size * Layout(nodes * g, stages).copies * passes
        pred.points.append(_point(ctx, nodes, nodes * g, seconds + lead, samples, passes))
        pred.points[-1].memory_gib = gib
        pred.timeline = segs
    return pred


def _whole(ctx: _Ctx, how: str) -> str:
    """``how`` for a setting without stages, under a config with them."""
    return f"pipeline.stages=1 {how}" if ctx.knobs.stages > 1 else how


def _whole_settings(ctx: _Ctx, **settings: Any) -> dict[str, Any]:
    """The dotted settings of :func:`_whole`'s ``how`` (keyword ``comm__compression`` is
    ``comm.compression``)."""
    out = {"pipeline.stages": 1} if ctx.knobs.stages > 1 else {}
    return {**out, **{k.replace("__", "."): v for k, v in settings.items()}}


def _rings(ctx: _Ctx) -> list[Prediction]:
    c, g, o = ctx.cluster, ctx.cluster.ranks_per_node, ctx.cluster.overhead_s
    dense = _whole_settings(ctx, comm__compression="none")
    flat = Prediction("ring", _whole(ctx, "comm.compression=none"), settings=dense)
    _sweep(ctx, flat, lambda n: _dense(ctx, n, lambda m: costs.flat_allreduce(
        m, n, g, c.intra, c.inter, o)), memory=lambda n: _memory(ctx, n))
    hier = Prediction("ring hierarchical", _whole(ctx, "comm.compression=none with "
                      "HOROVOD_HIERARCHICAL_ALLREDUCE=1 in the environment"), settings=dense)
    _sweep(ctx, hier, lambda n: _dense(ctx, n, lambda m: costs.hierarchical_allreduce(
        m, n, g, c.intra, c.inter, o)), memory=lambda n: _memory(ctx, n))
    return [flat, hier]


def _compressed(ctx: _Ctx) -> list[Prediction]:
    c, g, o = ctx.cluster, ctx.cluster.ranks_per_node, ctx.cluster.overhead_s
    out = []
    for method, prof in ctx.profile.compression.items():
        if method == "none":
            continue
        pred = Prediction(f"ring {method}", _whole(ctx, f"comm.compression={method}"),
                          settings=_whole_settings(ctx, comm__compression=method))
        pred.reason = _ratio_misfit(ctx, prof) or None
        out.append(pred)
        if pred.reason:
            continue
        kernel = prof.kernel_s * ctx.tscale
        if method in OVERLAPPED:
            def dense(n: int, p: MethodProfile = prof, k: float = kernel) -> Outcome:
                return _dense(ctx, n, lambda m: costs.flat_allreduce(m, n, g, c.intra, c.inter, o),
                              p.ratio, k)
            # The dense exchange holds what the ring holds (fp16's halves are transient).
            _sweep(ctx, pred, dense, memory=lambda n: _memory(ctx, n))
        else:
            def step(n: int, p: MethodProfile = prof, k: float = kernel) -> Outcome:
                return _compressing_step(ctx, n, p, k)
            _sweep(ctx, pred, step)
            pred.wire_bytes = run_wire_bytes(ctx.profile.gradient_bytes, prof.ratio,
                                             ctx.knobs.dense_share)
    return out


def run_wire_bytes(gradient_bytes: float, ratio: float, dense_share: float) -> float:
    """A compressing method's bytes a rank sends per step, averaged over the run: its dense start
    (``dense_share`` of the steps) sends the float32 gradient, the rest ``1 / ratio`` of it."""
    return gradient_bytes * (dense_share + (1.0 - dense_share) / ratio)


def _compressing_step(ctx: _Ctx, n: int, prof: MethodProfile, kernel_s: float) -> Outcome:
    """A compressing method's step, the run's mean: ``dense_share`` of the steps average the
    float32 gradient in an allreduce after the backward pass (the dense start: no kernels), the
    rest run the method's kernels and collective of ``M / ratio``."""
    c, g, o = ctx.cluster, ctx.cluster.ranks_per_node, ctx.cluster.overhead_s
    m, share = ctx.profile.gradient_bytes, ctx.knobs.dense_share
    wire = m / prof.ratio
    if prof.collective == "allgather":
        t = costs.ring_allgather(wire, n * g, ctx.link_between(n), o)
    else:
        t = costs.flat_allreduce(wire, n, g, c.intra, c.inter, o)
    kernel = kernel_s if n * g > 1 else 0.0
    label = f"{prof.collective} of {wire / 1e6:.2f} MB"
    if share > 0:
        dense = costs.flat_allreduce(m, n, g, c.intra, c.inter, o)
        t = share * dense + (1.0 - share) * t
        kernel *= 1.0 - share
        label += (f"; its dense start, {100 * share:.3g}% of the steps, an allreduce of "
                  f"{m / 1e6:.2f} MB (the run's mean)")
    return _after(ctx, t, kernel, label)


def _ratio_misfit(ctx: _Ctx, prof: MethodProfile) -> str:
    """Why a method's measured ratio does not price the config's run ("" when it does): the
    profile measured it at other ``comm`` settings than the config's."""
    if not ctx.knobs.comm:
        return ""
    if not prof.settings:
        return ("the profile does not record the comm settings its ratio was measured at; "
                "profile this config again (hvdtrain plan profile)")
    differ = [k for k in RATIO_KEYS if k in ctx.knobs.comm
              and float(prof.settings.get(k, float("nan"))) != float(ctx.knobs.comm[k])]
    return "" if not differ else (
        "its ratio was measured at " + ", ".join(f"comm.{k}={prof.settings.get(k)}" for k in differ)
        + ", the config has " + ", ".join(f"{ctx.knobs.comm[k]}" for k in differ)
        + "; profile this config again (hvdtrain plan profile)")


def _servers(ctx: _Ctx) -> list[Prediction]:
    c, g, o = ctx.cluster, ctx.cluster.ranks_per_node, ctx.cluster.overhead_s
    k, m = ctx.knobs.servers or c.servers.nodes, ctx.profile.gradient_bytes
    dedicated = Prediction(f"ps dedicated S={k}", _whole(ctx, f"comm.topology=ps ps.servers={k} "
                           "(one server rank on each server node)"),
                           settings=_whole_settings(ctx, comm__topology="ps", ps__servers=k))
    colocated = Prediction(f"ps colocated +{k} (BytePS)", "not in hvdtrain: BytePS's summation "
                           "on every worker (hvdtrain's sharded update is shard.stage=1)")
    if not k:
        dedicated.reason = "the cluster file has no server nodes (servers.nodes: 0)"
    elif k > c.servers.nodes:
        dedicated.reason = (f"ps.servers={k}: the cluster file has {c.servers.nodes} server "
                            "node(s), one server rank each")
    else:
        worker = c.inter.shared(g)
        sum_rate = c.servers.sum_gbyte_s * 1e9

        share, chunk = server_layout(m, k, ctx.knobs.chunk_kib)
        overlap = ctx.knobs.ps_overlap and ctx.profile.model.get("framework") == "torch"

        def dedicated_step(n: int) -> tuple[float, list[Segment]]:
            def cost(b: float, tail: float = chunk) -> float:
                return costs.dedicated_ps(b, n * g, k, worker, c.servers.link, sum_rate, o,
                                          share, tail)
            if not overlap:
                return _after(ctx, cost(m), 0.0, f"push + pull of {m / 1e6:.2f} MB")
            # Pushed as the backward pass produces the gradients, as the ring's buckets are; the
            # chunks stream, so only the step's last chunk waits for its pull.
            seconds, segs = _dense(ctx, n, lambda b: cost(b, 0.0))
            tail = costs.pull_tail(m, n * g, c.servers.link, chunk)
            update = segs[-1]
            segs[-1:] = [Segment("comm", "the last chunk's pull", update.start_s,
                                 update.start_s + tail),
                         Segment("compute", "update", update.start_s + tail, update.end_s + tail)]
            return seconds + tail, segs
        # bsp: each worker steps its own whole optimizer, as on the ring (parameter-servers.md).
        _sweep(ctx, dedicated, dedicated_step, memory=lambda n: _memory(ctx, n))

    def colocated_step(n: int) -> tuple[float, list[Segment]]:
        def cost(b: float) -> float:  # reduce within the node, BytePS between nodes, broadcast
            within = costs.hierarchical_allreduce(b, 1, g, c.intra, c.inter) if g > 1 else 0.0
            link = c.inter if not k else Link(
                bandwidth_gbit_s=min(c.inter.bandwidth_gbit_s, c.servers.bandwidth_gbit_s),
                latency_us=max(c.inter.latency_us, c.servers.latency_us))
            return within + (costs.byteps(b, n, k, link, o) if n > 1 or k else 0.0)
        return _dense(ctx, n, cost)
    _sweep(ctx, colocated, colocated_step)
    return [dedicated, colocated]


def server_layout(gradient_bytes: float, servers: int, chunk_kib: int) -> tuple[float, float]:
    """The busiest dedicated server's share of the flat float32 gradient and the chunk's bytes,
    as hvdtrain cuts and hashes it (:mod:`hvdtrain.ps.layout`)."""
    total = max(1, int(gradient_bytes // 4))
    layout = ChunkLayout(total, server_chunk(total, chunk_kib), servers)
    busiest = max(layout.elements(s) for s in range(servers))
    return busiest / total, 4.0 * layout.chunk


SHARDED = "shard stage 1"
"""The plan's name of sharded data parallel at stage 1 (the sharded update)."""


def shard_name(stage: int) -> str:
    """The plan's name of sharded data parallel at ``shard.stage`` 1-3."""
    return f"shard stage {stage}"


def _sharded(ctx: _Ctx) -> Prediction:
    """Sharded data parallel at stage 1 (``shard.stage=1``, ZeRO's): after the backward pass
    a reduce-scatter and an allgather, the two halves of the ring allreduce
    (:func:`costs.flat_half`), around the update of this rank's 1/N of the parameters."""
    c, g, o = ctx.cluster, ctx.cluster.ranks_per_node, ctx.cluster.overhead_s
    pred = Prediction(SHARDED, _whole(ctx, "shard.stage=1"),
                      settings=_whole_settings(ctx, shard__stage=1))

    m, ratio = ctx.profile.gradient_bytes, _scatter_ratio(ctx)
    pred.wire_bytes = m * ratio + m

    def step(n: int) -> tuple[float, list[Segment]]:
        rs = costs.flat_half(m * ratio, n, g, c.intra, c.inter, o)
        ag = costs.flat_half(m, n, g, c.intra, c.inter, o)
        f, b, upd = ctx.fwd, ctx.fwd + ctx.bwd, ctx.upd / (n * g)
        segs = [Segment("compute", "forward", 0.0, f), Segment("compute", "backward", f, b),
                Segment("comm", "reduce-scatter", b, b + rs),
                Segment("compute", "update of this rank's shard", b + rs, b + rs + upd),
                Segment("comm", "allgather", b + rs + upd, b + rs + ag + upd)]
        return b + rs + ag + upd, segs
    return _sweep(ctx, pred, step, memory=lambda n: _memory(ctx, n, 1))


def _scatter_ratio(ctx: _Ctx) -> float:
    """Wire bytes over float32 bytes of the shard stages' reduce-scatters: 2 bytes an element
    under ``comm.compression=fp16``; the all-gathers carry the float32 shards."""
    return 0.5 if ctx.knobs.compression == "fp16" else 1.0


def _unit_sharded(ctx: _Ctx, stage: int) -> Prediction:
    """Sharded data parallel at stage 2 or 3, unit by unit (:mod:`hvdtrain.plan.shard_step`):
    each reduce-scatter and all-gather is one flat ring's half (:func:`costs.flat_half`)."""
    c, g, o = ctx.cluster, ctx.cluster.ranks_per_node, ctx.cluster.overhead_s
    pred = Prediction(shard_name(stage), _whole(ctx, f"shard.stage={stage}"),
                      settings=_whole_settings(ctx, shard__stage=stage))
    units = shard_units(ctx.profile.layers, ctx.profile.gradient_bytes, ctx.fwd, ctx.bwd)
    ratio = _scatter_ratio(ctx)

    def step(n: int) -> tuple[float, list[Segment]]:
        def half(m: float) -> float:
            return costs.flat_half(m, n, g, c.intra, c.inter, o)

        def scatter(m: float) -> float:
            return half(m * ratio)
        upd = ctx.upd / (n * g)
        got: ShardStep = (stage2_step(units, upd, scatter, half, ratio) if stage == 2 else
                          stage3_step(units, upd, scatter, half, ctx.knobs.prefetch,
                                      ctx.knobs.reshard, ratio))
        # Each accumulated pass before the last has its collectives too (_sweep adds their
        # compute): the pass's time beyond its compute, once for each.
        extra = (ctx.knobs.accumulation - 1) * max(0.0, got.pass_s - ctx.fwd - ctx.bwd)
        pred.wire_bytes = got.wire_bytes + (ctx.knobs.accumulation - 1) * got.pass_wire
        segs = [Segment(lane, label, a + extra, b + extra) for lane, label, a, b in got.segments]
        if extra:
            segs.insert(0, Segment("comm", "the accumulated passes' collectives", 0.0, extra))
        return got.seconds + extra, segs
    return _sweep(ctx, pred, step, memory=lambda n: _memory(ctx, n, stage))


def _memory(ctx: _Ctx, nodes: int, stage: int = 0) -> Memory:
    """A rank's memory at ``shard.stage`` over every rank of ``nodes`` (0: the ring's and the
    dedicated servers' workers'): :mod:`hvdtrain.plan.memory`'s formula."""
    ranks = nodes * ctx.cluster.ranks_per_node
    params = ctx.profile.gradient_bytes / 4
    acts = activation_bytes(ctx.profile.layers, ctx.knobs.batch_size / ctx.profile.batch_size)
    gathered = 0.0
    if stage >= 3:
        units = shard_units(ctx.profile.layers, ctx.profile.gradient_bytes, 0.0, 0.0)
        gathered = _gathered(units, ctx.knobs.prefetch, ctx.knobs.reshard)
    return Memory(model_bytes(params, ranks, stage, ctx.knobs.state_bytes), acts, gathered)


def _gathered(units: list[ShardUnit], prefetch: int, reshard: bool) -> float:
    """Stage 3's parameters gathered whole at once: the unit-less ones for the whole pass, and
    the most ``prefetch`` + 1 consecutive units hold (with ``reshard``; else every unit, kept
    from its forward pass to its backward pass)."""
    root = sum(u.bytes for u in units if u.root)
    sizes = [u.bytes for u in units if not u.root]
    if not reshard:
        return root + sum(sizes)
    window = prefetch + 1
    return root + max((sum(sizes[i:i + window]) for i in range(len(sizes))), default=0.0)


def _stage_counts(ctx: _Ctx) -> list[int]:
    most = ctx.cluster.nodes * ctx.cluster.ranks_per_node
    counts, p = [], 2
    # Up to the ranks, and one count past the layers to say why more stages do not apply.
    while p <= max(most, 2) and p // 2 <= max(1, len(ctx.profile.layers)):
        counts.append(p)
        p *= 2
    if ctx.knobs.stages > 1 and ctx.knobs.stages not in counts:  # the config's own, priced too
        counts = sorted([*counts, ctx.knobs.stages])
    return counts


def pipelines(ctx: _Ctx) -> list[Prediction]:
    out, shard = [], ctx.knobs.shard_stage
    for stages in _stage_counts(ctx):
        for schedule in PLANNED_SCHEDULES:
            virtual = pieces_per_rank(schedule, ctx.knobs)
            micro = microbatch_count(stages, ctx.knobs.microbatches, virtual)
            pred = Prediction(pipeline_name(stages, micro, schedule, virtual, shard),
                              f"pipeline.stages={stages} pipeline.microbatches={micro} "
                              f"pipeline.schedule={schedule}"
                              + (f" pipeline.virtual_stages={virtual}" if virtual > 1 else "")
                              + (" train.backward_passes_per_step=1"
                                 if ctx.knobs.accumulation > 1 else ""), microbatches=micro,
                              settings=_pipeline_settings(ctx, stages, micro, schedule, virtual))
            pred.reason = (_pipeline_misfit(ctx, stages, virtual, schedule)
                           or _pipeline_refused(ctx, stages, schedule, virtual, micro)
                           or ctx.refused(pred.settings) or None)
            if not pred.reason:
                step = _pipeline_step(ctx, stages, micro, schedule, virtual)

                def point(n: int, s: int = stages, st: PipelineStep = step) -> Outcome:
                    return _pipeline_point(ctx, n, s, st, shard)

                def memory(n: int, s: int = stages, m: int = micro, sc: str = schedule,
                           v: int = virtual) -> Memory:
                    # Where the ranks hold no whole copies the point says so (its step).
                    copies = max(1, n * ctx.cluster.ranks_per_node // s)
                    return _pipeline_memory(ctx, s, m, sc, v, copies, shard)
                _sweep(ctx, pred, point, stages, memory)
            out.append(pred)
    return out


def _pipeline_memory(ctx: _Ctx, stages: int, micro: int, schedule: str, virtual: int,
                     copies: int = 1, shard: int = 0) -> Memory:
    """The busiest rank of a pipeline copy: its layers' parameters, gradients and optimizer
    state (:func:`model_bytes` at ``shard.stage`` ``shard`` over the stage's ``copies``), and
    the activations of the micro-batches it holds at once, its layers' output bytes for each:
    ``m`` under GPipe, ``P - s`` (at most ``m``) on stage ``s`` under 1F1B (PipeDream-Flush's
    bound), and as 1F1B's ``P`` on every rank's pieces under interleaved 1F1B (an
    approximation: Megatron's interleaving holds somewhat more)."""
    share = ctx.knobs.batch_size / micro / ctx.profile.batch_size
    if schedule == "interleaved_1f1b":
        pieces = split_layers(ctx.profile.layers, stages * virtual)
        held = [[x for p in pieces[r::stages] for x in p] for r in range(stages)]
        depth = [min(micro, stages)] * stages
    else:
        held = split_layers(ctx.profile.layers, stages)
        depth = [micro if schedule == "gpipe" else min(micro, stages - r) for r in range(stages)]
    return max((Memory(model_bytes(sum(x.params for x in layers), copies, shard,
                                   ctx.knobs.state_bytes),
                       d * activation_bytes(layers, share))
                for layers, d in zip(held, depth, strict=True)), key=lambda m: m.total)


def _pipeline_settings(ctx: _Ctx, stages: int, micro: int, schedule: str,
                       virtual: int) -> dict[str, Any]:
    """The dotted settings of a pipeline setting's ``how``."""
    out: dict[str, Any] = {"pipeline.stages": stages, "pipeline.microbatches": micro,
                           "pipeline.schedule": schedule}
    if virtual > 1:
        out["pipeline.virtual_stages"] = virtual
    if ctx.knobs.accumulation > 1:
        out["train.backward_passes_per_step"] = 1
    return out


def _pipeline_refused(ctx: _Ctx, stages: int, schedule: str, virtual: int, micro: int) -> str:
    """What training's checks of the ``pipeline`` section say of this setting ("" when it runs):
    :func:`hvdtrain.pipeline.schedules.check_pipeline`, and a copy's batch a multiple of ``m``."""
    framework = str(ctx.profile.model.get("framework", ""))
    if framework not in SCHEDULES[schedule].frameworks:
        framework = SCHEDULES[schedule].frameworks[0]  # a published profile's: any that runs it
    try:
        check_pipeline(stages=stages, microbatches=ctx.knobs.microbatches, schedule=schedule,
                       virtual_stages=virtual, split="auto", framework=framework)
    except ConfigError as err:
        return str(err)
    if ctx.knobs.batch_size % micro:
        return (f"data.batch_size={ctx.knobs.batch_size}: with pipeline stages it is a copy's "
                f"batch, split into pipeline.microbatches={micro}: must be a multiple of it")
    return ""


def pieces_per_rank(schedule: str, knobs: Knobs) -> int:
    """The model pieces a rank holds under ``schedule``: ``v`` for interleaved 1F1B, else 1."""
    if schedule != "interleaved_1f1b":
        return 1
    return knobs.virtual_stages if knobs.virtual_stages > 1 else DEFAULT_VIRTUAL


def pipeline_name(stages: int, micro: int, schedule: str, virtual: int, shard: int = 0) -> str:
    """A pipeline setting's name in the plan's table (``shard``: its copies' ``shard.stage``)."""
    return (f"pipeline P={stages} m={micro} {schedule}" + (f" v={virtual}" if virtual > 1 else "")
            + (f" {shard_name(shard)}" if shard else ""))


def _pipeline_misfit(ctx: _Ctx, stages: int, virtual: int, schedule: str) -> str:
    """Why this pipeline cannot run the profiled model ("" when it can)."""
    layers, framework = ctx.profile.layers, str(ctx.profile.model.get("framework", ""))
    if not layers:
        return "the profile lists no layers (the model is not a layer list)"
    runs = SCHEDULES[schedule].frameworks
    # A published profile names no framework of hvdtrain's: every schedule applies to it.
    if framework in {f for s in SCHEDULES.values() for f in s.frameworks} and framework not in runs:
        return schedule_refused(schedule, framework)  # the compatibility table's reason
    if stages * virtual > len(layers):
        pieces = f"{stages} x {virtual} pieces" if virtual > 1 else f"stages ({stages})"
        return f"more {pieces} than the model's layers ({len(layers)})"
    return ""


def _pipeline_step(ctx: _Ctx, stages: int, micro: int, schedule: str,
                   virtual: int) -> PipelineStep:
    """One copy's schedule: the same at every node count (a copy's ranks sit on one node when
    ``P`` divides the ranks per node, else they span nodes)."""
    c = ctx.cluster
    link = c.intra if _same_node(ctx, stages) else c.inter
    # A copy's batch is data.batch_size, as training samples it (docs/pipeline.md).
    share = ctx.knobs.batch_size / micro / ctx.profile.batch_size
    return pipeline_step(ctx.profile.layers, stages, micro, schedule, share, share,
                         lambda b: costs.send(b, link, c.overhead_s), virtual, c.compute_speed,
                         unblocked=ctx.profile.model.get("framework") == "torch")


def _same_node(ctx: _Ctx, stages: int) -> bool:
    g = ctx.cluster.ranks_per_node
    return stages <= g and g % stages == 0


def _pipeline_point(ctx: _Ctx, nodes: int, stages: int, step: PipelineStep,
                    shard: int = 0) -> Outcome:
    c, g, o = ctx.cluster, ctx.cluster.ranks_per_node, ctx.cluster.overhead_s
    ranks = nodes * g
    if ranks < stages or ranks % stages:
        return f"{ranks} ranks do not hold copies of {stages} stages"
    copies = Layout(ranks, stages).copies  # the job's layout of ranks, as training makes it
    biggest = max(step.stage_bytes)
    if shard:
        return _sharded_pipeline_point(ctx, nodes, stages, step, copies, biggest, shard)
    if _same_node(ctx, stages):
        shared = c.inter.shared(stages)
        dp = costs.hierarchical_allreduce(biggest, nodes, g // stages, c.intra, shared, o)
    else:
        shared = c.inter.shared(g)
        dp = costs.ring_allreduce(biggest, copies, shared, o)
    update = ctx.upd / stages
    micro = round(step.busy_s / (step.forward_s + step.backward_s)) if step.busy_s else 0
    segs = [Segment("compute", f"{micro} micro-batches, slowest stage", 0.0, step.busy_s),
            Segment("bubble", f"bubble {step.bubble:.0%}", step.busy_s, step.span_s),
            Segment("comm", f"stage allreduce {biggest / 1e6:.2f} MB over {copies} copies",
                    step.span_s, step.span_s + dp),
            Segment("compute", "update", step.span_s + dp, step.span_s + dp + update)]
    return step.span_s + dp + update, segs


def _sharded_pipeline_point(ctx: _Ctx, nodes: int, stages: int, step: PipelineStep,
                            copies: int, biggest: float, shard: int = 1) -> Outcome:
    """A pipeline whose stages' copies shard the optimizer state (``shard.stage=1``): after
    the schedule, the largest stage's reduce-scatter and all-gather among its copies (one flat
    ring each way, the node's link shared by the stages' rings), around the update of its
    shard. Stages 2-3 reduce-scatter every micro-batch's gradient (m of them) and stage 3
    gathers its shards before each micro-batch's forward and backward pass (2m), priced here
    as if none overlapped the schedule (an upper bound: they run inside its passes)."""
    c, g, o = ctx.cluster, ctx.cluster.ranks_per_node, ctx.cluster.overhead_s
    ratio = _scatter_ratio(ctx)
    if _same_node(ctx, stages):  # g / P copies of each stage a node, P rings through its link
        def half(m: float) -> float:
            return costs.flat_half(m, nodes, g // stages, c.intra, c.inter.shared(stages), o)
    else:  # a copy spans nodes: g rings through each node's link
        def half(m: float) -> float:
            shared = c.inter.shared(g)
            return costs.flat_half(m, copies, 1, shared, shared, o)
    t = step.span_s
    micro = round(step.busy_s / (step.forward_s + step.backward_s)) if step.busy_s else 0
    scatters = max(micro, 1) if shard >= 2 else 1
    gathers = 2 * max(micro, 1) if shard == 3 else 1
    rs, ag = scatters * half(biggest * ratio), gathers * half(biggest)
    upd = ctx.upd / stages / copies
    segs = [Segment("compute", f"{micro} micro-batches, slowest stage", 0.0, step.busy_s),
            Segment("bubble", f"bubble {step.bubble:.0%}", step.busy_s, t),
            Segment("comm", f"stage reduce-scatter {biggest / 1e6:.2f} MB over {copies} copies",
                    t, t + rs),
            Segment("compute", "update of this rank's shard", t + rs, t + rs + upd),
            Segment("comm", "stage all-gather", t + rs + upd, t + rs + upd + ag)]
    return t + rs + upd + ag, segs


COST_ORDER = ("ring", "ps", "shard", "pipeline")
"""The order the strategies' predictions are listed in before they are ranked (a tie keeps it)."""


def _table_wins(ctx: _Ctx, preds: list[Prediction]) -> list[Prediction]:
    """``preds`` with training's reason where the table refuses their settings: the run's own
    reason wins over the plan's, since no cluster makes the run accept it."""
    for pred in preds:
        reason = ctx.refused(pred.settings)
        if reason:
            pred.reason, pred.points, pred.timeline = reason, [], []
    return preds


def rings(ctx: _Ctx) -> list[Prediction]:
    """The ring's cost entry: Horovod's allreduce, dense and with each compression method."""
    return _table_wins(ctx, [*_rings(ctx), *_compressed(ctx)])


def servers(ctx: _Ctx) -> list[Prediction]:
    """The parameter servers' cost entry: dedicated server ranks, and colocated BytePS."""
    return _table_wins(ctx, _servers(ctx))


def sharded(ctx: _Ctx) -> list[Prediction]:
    """Sharded data parallel's cost entry: ``shard.stage`` 1, 2 and 3."""
    preds = [_sharded(ctx), _unit_sharded(ctx, 2), _unit_sharded(ctx, 3)]
    if ctx.knobs.shard_group != "all":  # a config's shard.group=node, which these rows keep
        for pred in preds:
            pred.reason, pred.points, pred.timeline = GROUP_UNPRICED, [], []
    return _table_wins(ctx, preds)


GROUP_UNPRICED = ("shard.group='node': the plan prices shard.group=all only (every "
                  "data-parallel rank shards); plan with shard.group=all")


def _cost(name: str) -> Callable[[_Ctx], list[Prediction]]:
    """The strategy's cost function, as the registry names it (:attr:`Strategy.cost`)."""
    module, _, function = strategy(name).cost.partition(":")
    found: Callable[[_Ctx], list[Prediction]] = getattr(import_module(module), function)
    return found


def plan(profile: ModelProfile, cluster: Cluster, knobs: Knobs,
         refuse: Refuse | None = None) -> Plan:
    """Every setting's prediction, ranked by samples/s at the most nodes it runs on; with
    ``refuse``, a setting training would refuse is not applicable, with training's reason.
    Each strategy prices its own settings (its cost entry in the strategies' registry)."""
    ctx = _Ctx(profile, cluster, knobs, refuse)
    preds = [pred for name in COST_ORDER for pred in _cost(name)(ctx)]

    def rank(p: Prediction) -> tuple[int, int, float]:
        best = p.best
        if best is None:
            return (1, 0, 0.0)
        return (0, -best.nodes, -(best.samples_per_s or 0.0))
    preds.sort(key=rank)
    alone = ctx.lead + ctx.compute
    return Plan(profile.name, cluster, knobs, knobs.accumulation * knobs.batch_size / alone, preds)
