"""``train(cfg)``: the one run driver, from plug-in checks to ``summary.json``, elastic or not.

Every rank calls it (under ``horovodrun``, ``srun`` or alone). With dedicated parameter servers
(``comm.topology=ps``) the job's last ``ps.servers`` ranks serve instead (:func:`serve`), before
any framework is imported; the other ranks train as below, among themselves. The path is the same
in both modes:

1. check the plug-ins, build the dataset and the engine (Horovod starts, nothing is written yet);
2. rank 0 alone decides where the run starts (:func:`start_on_rank0`: the run directory, the
   checkpoint to resume from) and turns any problem into a message;
3. every rank receives rank 0's start and state: by one broadcast, or, in elastic mode, by the
   elastic state's ``sync`` (no collective may run before ``hvd.elastic.run``'s function);
4. :class:`Session` runs the loop from that position; elastic mode runs it again after each reset,
   from the last commit, at the new world size;
5. rank 0 writes the summary.
"""

from __future__ import annotations

import os
import resource
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvdtrain.checkpoint import CheckpointManager, checked_position, verify
from hvdtrain.config import Config
from hvdtrain.data.contracts import Dataset
from hvdtrain.engine import Engine, make_engine
from hvdtrain.errors import HvdtrainError
from hvdtrain.layout import dedicated
from hvdtrain.loop import Callback, Position, Stopped
from hvdtrain.malloc import return_freed_blocks
from hvdtrain.observe.watchdog import StallWatchdog
from hvdtrain.ps.mpi import end_job_at_exit, split
from hvdtrain.registry import DATASETS, MODELS
from hvdtrain.rundir import RunDir
from hvdtrain.session import Session, Start
from hvdtrain.signals import StopRequest
from hvdtrain.world import World


@dataclass
class TrainResult:
    """What a finished run returns on every rank."""

    summary: dict[str, Any]
    run_dir: Path
    local_eval: dict[str, float]
    """This rank's own evaluation sums, before the cross-rank allreduce."""
    engine: Engine | None
    """The engine that trained; None on a parameter server's rank, which trains nothing."""


def make_dataset(cfg: Config) -> Dataset:
    """Instantiates the configured dataset with ``data.options``."""
    cls = DATASETS.get(cfg.data.name)
    try:
        dataset = cls(**cfg.data.options)
    except TypeError as exc:
        raise HvdtrainError(f"data.options for {cfg.data.name!r}: {exc}") from None
    if not isinstance(dataset, Dataset):
        raise HvdtrainError(f"data.name={cfg.data.name!r} is not a hvdtrain.data.contracts.Dataset")
    return dataset


def find_checkpoint(cfg: Config, run_dir: RunDir) -> Path | None:
    """The checkpoint that ``checkpoint.resume`` asks for, or None to start afresh."""
    resume = cfg.checkpoint.resume
    if resume == "none":
        return None
    if resume == "auto":
        return CheckpointManager(cfg.checkpoint, run_dir.checkpoints).latest_valid()
    path = Path(resume)
    problem = verify(path) if path.is_file() else "no such file"
    if problem:
        raise HvdtrainError(f"checkpoint.resume={resume!r}: {problem}")
    return path


def restore(engine: Engine, path: Path, cfg: Config) -> Position:
    """Restores the checkpoint ``path`` into this rank's engine (no communication) and returns
    where it stood; raises :class:`HvdtrainError` when it does not fit this run."""
    engine.restore_from = path  # the parts of a checkpoint written in parts lie beside it
    meta = engine.load_state(path.read_bytes(), f"checkpoint {path}")
    if meta.get("framework") != cfg.framework:
        raise HvdtrainError(f"checkpoint {path} was written by {meta.get('framework')}, "
                            f"this run trains with {cfg.framework}")
    written = meta.get("config", {}).get("optim", {}).get("name")
    if written is not None and written != cfg.optim.name:  # its state has another shape
        raise HvdtrainError(f"checkpoint {path} holds the state of optim.name={written!r}, this run "
                            f"has optim.name={cfg.optim.name!r}: resume with {written!r}, or start "
                            "afresh (checkpoint.resume=none, another log.dir)")
    return Position(**checked_position(meta, f"checkpoint {path}"))


def start_on_rank0(cfg: Config, run_dir: RunDir, engine: Engine) -> Start:
    """Rank 0's start (no communication): restores the checkpoint to resume from and prepares the
    run directory. Only rank 0 reads them: other hosts may not see its file system (a checkpoint
    written in parts by pipeline stages is the exception: each rank reads the parts it needs)."""
    try:
        path = find_checkpoint(cfg, run_dir)
        if path is None:
            run_dir.check_unused(cfg.log.overwrite)
        position = restore(engine, path, cfg) if path else None
        run_dir.prepare(cfg, position.step if position else None)
    except HvdtrainError as exc:
        return Start(error=exc)
    return Start(position or Position(), resumed=position is not None)


def train(cfg: Config, callbacks: Sequence[Callback] = (),
          engine_factory: Callable[[Config, Dataset], Engine] = make_engine) -> TrainResult:
    """Trains ``cfg`` on this rank and returns the result; rank 0 writes the run directory.

    ``callbacks`` observe the loop (:class:`hvdtrain.loop.Callback`) on every rank.
    ``engine_factory`` builds the engine (the configured framework's; the unit tests pass a
    framework-free one).
    """
    if not dedicated(cfg):
        return _train(cfg, callbacks, engine_factory)
    world = split(cfg.ps.servers)  # before any framework is imported: servers import none
    if world.is_server:
        return serve(cfg)
    try:
        return _train(cfg, callbacks, engine_factory)
    except Stopped:  # every worker stopped at the same step and told the servers
        raise
    except BaseException as exc:
        end_job_at_exit(world, exc)
        raise


def _train(cfg: Config, callbacks: Sequence[Callback],
           engine_factory: Callable[[Config, Dataset], Engine]) -> TrainResult:
    """:func:`train` on a rank that trains."""
    DATASETS.check(cfg.data.name)
    MODELS[cfg.framework].check(cfg.model.name)
    run_dir = RunDir(cfg.run_dir)
    if cfg.shard.stage >= 2:  # its units' gathered parameters and gradients come and go a step
        return_freed_blocks()
    dataset = make_dataset(cfg)
    engine = engine_factory(cfg, dataset)
    start = start_on_rank0(cfg, run_dir, engine) if engine.rank == 0 else Start()
    session = Session(cfg, run_dir, engine, dataset, callbacks, start.resumed)
    mode = _mode(cfg, session, start)
    summary = None
    watchdog = StallWatchdog(cfg.train.stall_timeout_s, run_dir, engine.rank, engine.size,
                             before_exit=session.flush_metrics)
    try:
        with StopRequest() as stop, watchdog as dog:
            try:
                summary = mode.run(stop, dog.beat)
            except Stopped:  # every rank stopped at the same step: the exchange ends cleanly
                engine.finish()
                raise
            engine.finish()
    finally:
        session.close(summary)
    placements = engine.collectives.allgather_object((*placement(), session.startup_s,
                                                      peak_rss_mb()))
    keys = ("hosts", "net_namespaces", "startup_s", "peak_rss_mb")  # one list a key, by rank
    summary = {**summary, **{key: list(column)
                             for key, column in zip(keys, zip(*placements, strict=True),
                                                    strict=True)}}
    tokenizer = getattr(dataset, "tokenizer", None)  # the tokens' (docs/huggingface.md)
    if tokenizer is not None:
        summary["tokenizer"] = str(tokenizer)
    if cfg.comm.topology == "ps":  # world_size counts the workers: say what else ran
        servers = cfg.ps.servers if dedicated(cfg) else engine.size
        summary |= {"topology": "ps", "ps_placement": cfg.ps.placement, "ps_servers": servers}
    if cfg.shard.stage:  # and over how many ranks a stage's parameters are sharded
        layout = getattr(engine, "layout", None)
        summary |= {"shard_stage": cfg.shard.stage, "shard_group": cfg.shard.group,
                    "shard_ranks": layout.sharding(engine.rank)[1] if layout else engine.size}
    if engine.rank == 0:
        run_dir.write_summary(summary)
        mode.finish(run_dir)
    assert session.loop is not None
    return TrainResult(summary=summary, run_dir=run_dir.root, local_eval=session.loop.local_eval,
                       engine=engine)


def serve(cfg: Config) -> TrainResult:
    """A parameter server's part of the training (imports NumPy and mpi4py only): serves the
    workers until they are done; a failure ends the whole job with a line naming this server."""
    from hvdtrain.ps.server import run_server

    steps = run_server(split(cfg.ps.servers))
    return TrainResult(summary={"role": "server", "steps_served": steps}, run_dir=cfg.run_dir,
                       local_eval={}, engine=None)


def placement() -> tuple[str, str]:
    """This rank's host, named as its launcher knows it (:func:`launcher_host`), and its network
    namespace: what tells where the ranks of a run ran."""
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:  # no /proc (not Linux)
        netns = ""
    return launcher_host(os.environ), netns


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (what a memory limit such as Slurm's
    cgroup compares, less the page cache): the model, optimizer state, activations and runtime."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


def launcher_host(environ: Mapping[str, str]) -> str:
    """The host a rank runs on, by the variables its launcher set for it.

    horovodrun's Gloo launcher sets ``HOROVOD_HOSTNAME`` (its ``-H`` name) for each rank. A rank
    that Open MPI's daemon started (``OMPI_COMM_WORLD_RANK``) takes its own host name: horovodrun
    ``--mpi`` forwards the launching shell's whole environment with ``-x``, so inside a Slurm job
    every rank carries the batch node's ``SLURMD_NODENAME``. Otherwise ``SLURMD_NODENAME`` is the
    rank's own node (``srun`` sets it per task), else the host name.
    """
    if environ.get("HOROVOD_HOSTNAME"):
        return environ["HOROVOD_HOSTNAME"]
    if "OMPI_COMM_WORLD_RANK" not in environ and environ.get("SLURMD_NODENAME"):
        return environ["SLURMD_NODENAME"]
    return socket.gethostname()


def _mode(cfg: Config, session: Session, start: Start) -> FixedMode | Any:
    """The fixed-size mode, or elastic mode (imported only then: it loads Horovod's elastic code)."""
    if not cfg.elastic.enabled:
        return FixedMode(session, start)
    from hvdtrain.elastic_mode import ElasticMode
    return ElasticMode(cfg, session, start)


class FixedMode:
    """A run at a fixed world size: one broadcast gives every rank rank 0's start and state."""

    def __init__(self, session: Session, start: Start) -> None:
        self.session, self.start = session, start

    def run(self, stop: Callable[[], bool], heartbeat: Callable[[], None]) -> dict[str, Any]:
        """Shares the start, then trains to the end."""
        engine = self.session.engine
        start = engine.collectives.broadcast_object(self.start)
        if start.error:
            raise start.error
        engine.broadcast_state()
        return self.session.run(World.of(self.session.cfg, engine.data_size), start.position,
                                stop, heartbeat)

    def finish(self, run_dir: RunDir) -> None:
        """Nothing more to write at a fixed size."""
