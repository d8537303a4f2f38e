"""``hvdtrain plan``: the command's steps (the CLI parses, this runs).

``hvdtrain plan [CONFIG] --cluster CLUSTER.yaml [KEY=VALUE ...] [--profile PROFILE.json]
[--json OUT.json] [--html OUT.html] [--plot OUT.png]`` prints the ranked table and writes the
outputs asked for; without ``--profile`` it profiles CONFIG's model on this machine first.
``hvdtrain plan profile CONFIG --out PROFILE.json [KEY=VALUE ...]`` writes a profile;
``horovodrun -np N ... hvdtrain plan calibrate --out CLUSTER.yaml`` writes a cluster file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hvdtrain.compression.rules import dense_start
from hvdtrain.config import Config, load_config
from hvdtrain.errors import ConfigError
from hvdtrain.pipeline.schedules import microbatch_count
from hvdtrain.plan.cluster import Cluster, load_cluster
from hvdtrain.plan.memory import state_bytes
from hvdtrain.plan.predict import (
    GROUP_UNPRICED,
    Knobs,
    Plan,
    Refuse,
    pieces_per_rank,
    pipeline_name,
    plan,
    shard_name,
)
from hvdtrain.plan.profile import RATIO_KEYS, ModelProfile, check_matches, load_profile, save_profile
from hvdtrain.plan.stages import PLANNED_SCHEDULES
from hvdtrain.strategies.table import refusal, with_settings
from hvdtrain.world import World

PROFILE_STEPS = 5
"""Steps ``hvdtrain plan profile`` times (after one untimed step that warms up)."""


@dataclass(frozen=True)
class Request:
    """What the command line asked for."""

    items: Sequence[str]
    """``[profile] [CONFIG] [KEY=VALUE ...]`` as given."""
    cluster: str | None = None
    profile: str | None = None
    json: str | None = None
    html: str | None = None
    plot: str | None = None
    out: str | None = None


def _config_and_overrides(items: Sequence[str]) -> tuple[str | None, list[str]]:
    files = [i for i in items if "=" not in i]
    if len(files) > 1:
        raise ConfigError(f"hvdtrain plan: one config file, not {len(files)} ({', '.join(files)})")
    return (files[0] if files else None), [i for i in items if "=" in i]


def measure(config: str, overrides: Sequence[str], steps: int = PROFILE_STEPS) -> ModelProfile:
    """Profiles the config's model on this machine, one rank, with its framework."""
    cfg = load_config(config, overrides)
    if cfg.framework == "tensorflow":
        from hvdtrain.tensorflow.plan_profile import profile_model as profile_tf

        return profile_tf(cfg, steps)
    from hvdtrain.torch.plan_profile import profile_model

    return profile_model(cfg, steps)


def run(request: Request) -> Plan | ModelProfile | Cluster | None:
    """Runs the command: writes a profile (``plan profile``) or a cluster file (``plan
    calibrate``; None on the rank that does not write it), or plans and writes the outputs."""
    items = list(request.items)
    if items and items[0] == "calibrate":
        if request.out is None or len(items) > 1:
            raise ConfigError("hvdtrain plan calibrate --out CLUSTER.yaml: under horovodrun -np N (N >= 2)")
        from hvdtrain.torch.plan_calibrate import calibrate

        return load_cluster(request.out) if calibrate(request.out) else None
    if items and items[0] == "profile":
        config, overrides = _config_and_overrides(items[1:])
        if config is None or request.out is None:
            raise ConfigError("hvdtrain plan profile CONFIG --out PROFILE.json: needs both")
        measured = measure(config, overrides)
        save_profile(measured, request.out)
        return measured
    return _plan(request, items)


def knobs_of(cfg: Config) -> Knobs:
    """What the plan reads of ``cfg``, through the functions training reads it with: the
    accumulated passes of :class:`hvdtrain.world.World`, ``pipeline.microbatches`` as configured
    (each pipeline setting resolves it with training's ``microbatch_count``), a pipeline
    copy's batch ``data.batch_size`` (docs/pipeline.md), the ``shard`` keys, and the optimizer
    state's bytes a parameter (:func:`~hvdtrain.plan.memory.state_bytes`)."""
    dedicated = cfg.comm.topology == "ps" and cfg.ps.placement == "dedicated"
    return Knobs(batch_size=cfg.data.batch_size, cycle_ms=cfg.comm.cycle_time_ms,
                 microbatches=cfg.pipeline.microbatches,
                 virtual_stages=cfg.pipeline.virtual_stages, chunk_kib=cfg.ps.chunk_kib,
                 ps_overlap=cfg.ps.overlap, accumulation=World.of(cfg, 1).accumulation,
                 stages=cfg.pipeline.stages, servers=cfg.ps.servers if dedicated else 0,
                 comm={k: float(getattr(cfg.comm, k)) for k in RATIO_KEYS},
                 compression=cfg.comm.compression, dense_share=dense_share(cfg),
                 state_bytes=state_bytes(cfg.optim.name, cfg.optim.momentum),
                 prefetch=cfg.shard.prefetch, reshard=cfg.shard.reshard_after_forward,
                 shard_stage=cfg.shard.stage, shard_group=getattr(cfg.shard, "group", "all"))


def dense_share(cfg: Config) -> float:
    """The share of the run's steps a compressing method averages dense first, as training
    resolves the dense start (:func:`hvdtrain.compression.rules.dense_start`, the one rule) over
    ``train.max_steps``. Without ``train.max_steps`` (the steps of ``train.epochs`` depend on the
    data set's size, which the plan does not read) the default ``comm.dense_steps: -1`` prices
    ``comm.dense_fraction``, exact for a run of ``comm.dense_min_steps / comm.dense_fraction``
    steps or more (1,000 with the defaults), where the floor no longer binds; a count needs it."""
    steps, total = cfg.comm.dense_steps, cfg.train.max_steps
    if steps == 0:
        return 0.0
    if not total:
        if steps < 0:
            return cfg.comm.dense_fraction
        raise ConfigError(f"comm.dense_steps={steps}: the plan prices a dense start as a share of "
                          "the run; set train.max_steps (the run's steps) or price "
                          "comm.dense_fraction instead (comm.dense_steps=-1)")
    return dense_start(steps, cfg.comm.dense_fraction, cfg.comm.dense_min_steps, total) / total


def refuser(cfg: Config) -> Refuse:
    """The plan's question to training's compatibility table: the reason ``cfg`` changed by a
    setting's dotted settings cannot run (the very message ``hvdtrain train`` raises), or None."""
    def refuse(settings: Mapping[str, Any]) -> str | None:
        return refusal(with_settings(cfg, settings))
    return refuse


def configured_setting(cfg: Config, cluster: Cluster, knobs: Knobs) -> str:
    """The name of the setting ``cfg`` runs, as the plan names it; a one-line error when it
    cannot run on ``cluster`` at any node count, or when the plan would price another run."""
    most = cluster.nodes * cluster.ranks_per_node
    stages = cfg.pipeline.stages
    if cfg.train.precision != "fp32":
        # The profile times float32 compute (hvdtrain plan profile does not autocast).
        raise ConfigError(f"train.precision={cfg.train.precision!r}: the plan prices float32 "
                          "compute only (its profile times fp32); plan with "
                          "train.precision=fp32")
    if cfg.shard.stage and getattr(cfg.shard, "group", "all") != "all":
        raise ConfigError(GROUP_UNPRICED)
    if stages > 1:
        if not any(n * cluster.ranks_per_node % stages == 0
                   for n in range(1, cluster.nodes + 1)):
            raise ConfigError(f"pipeline.stages={stages}: no node count of this cluster (1 to "
                              f"{cluster.nodes} x {cluster.ranks_per_node} ranks) holds whole "
                              "copies of the pipeline")
        if cfg.pipeline.schedule not in PLANNED_SCHEDULES:
            raise ConfigError(f"pipeline.schedule={cfg.pipeline.schedule!r}: the plan prices "
                              f"{' and '.join(PLANNED_SCHEDULES)} only")
        schedule = cfg.pipeline.schedule
        virtual = pieces_per_rank(schedule, knobs)
        return pipeline_name(stages, microbatch_count(stages, cfg.pipeline.microbatches,
                                                      virtual), schedule, virtual, cfg.shard.stage)
    if cfg.comm.topology == "ps" and cfg.ps.consistency != "bsp":
        raise ConfigError(f"ps.consistency={cfg.ps.consistency!r}: the plan prices bsp only (every "
                          "step waits for all workers); plan with ps.consistency=bsp")
    if cfg.shard.stage >= 1:
        return shard_name(cfg.shard.stage)
    if cfg.comm.topology == "ps":
        if not cluster.servers.nodes:
            raise ConfigError("comm.topology=ps: the cluster file has no server nodes "
                              "(servers.nodes); add them or plan comm.topology=ring")
        if cfg.ps.servers > cluster.servers.nodes:
            raise ConfigError(f"ps.servers={cfg.ps.servers}: the cluster file has "
                              f"{cluster.servers.nodes} server node(s) (servers.nodes), one "
                              "server rank each")
        return f"ps dedicated S={cfg.ps.servers}"
    if most < 2:
        return "ring"
    return "ring" if cfg.comm.compression == "none" else f"ring {cfg.comm.compression}"


def _plan(request: Request, items: list[str]) -> Plan:
    from hvdtrain.plan import html, render

    if request.cluster is None:
        raise ConfigError("hvdtrain plan: --cluster CLUSTER.yaml is required")
    config, overrides = _config_and_overrides(items)
    cluster = load_cluster(request.cluster)
    knobs: Knobs | None = None
    if config is not None:
        cfg = load_config(config, overrides)
        knobs = knobs_of(cfg)
    if request.profile is not None:
        model = load_profile(request.profile)
        if config is not None:
            check_matches(model, cfg.framework, cfg.model.name, cfg.model.options)
    elif config is not None:
        model = measure(config, overrides)
    else:
        raise ConfigError("hvdtrain plan: give a CONFIG to profile, or --profile PROFILE.json")
    result = plan(model, cluster, knobs or Knobs(batch_size=model.batch_size),
                  refuser(cfg) if config is not None else None)
    if config is not None:
        result.configured = configured_setting(cfg, cluster, result.knobs)
        row = next((p for p in result.predictions if p.setting == result.configured), None)
        if row is None:  # a profile without the config's compression method
            raise ConfigError(f"the profile has no figures for the config's setting "
                              f"({result.configured}, comm.compression={cfg.comm.compression}); "
                              "profile this config with hvdtrain plan profile")
        if row.reason:  # the config's own run must be the one priced
            raise ConfigError(f"the config's setting ({result.configured}): {row.reason}")
    written = []  # the files first: a console cut short (``| head``) must not lose them
    for path, write in ((request.json, render.write_json), (request.html, html.write_html),
                        (request.plot, render.write_plot)):
        if path:
            write(result, path)
            written.append(path)
    print(render.table(result))
    for path in written:
        print(f"[hvdtrain] wrote {path}")
    return result
