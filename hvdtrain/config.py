"""The run configuration: nested, typed, documented dataclasses.

Sources, later ones winning: the YAML file, ``HVDTRAIN_<SECTION>__<KEY>`` environment variables
(``HVDTRAIN_TRAIN__EPOCHS=3``), then dotted command-line overrides (``train.epochs=3``). Every key,
type and range is checked before anything runs; a mistake raises :class:`ConfigError` naming the
key, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hvdtrain.choices import DEVICES, PRECISIONS
from hvdtrain.configcheck import check_section, coerce_value, nearest_key, refuse_unread, shown
from hvdtrain.errors import ConfigError, os_failure
from hvdtrain.strategies.comm import METHODS, RETIRED_KEYS, check_comm
from hvdtrain.strategies.ps_section import check_ps, check_ps_unread
from hvdtrain.strategies.schedules import SCHEDULE_NAMES, check_pipeline_section
from hvdtrain.strategies.table import check as check_strategies


def _opt(default: Any, *, min: float | None = None, max: float | None = None,
         choices: Sequence[str] | None = None) -> Any:
    """A dataclass field with the range or choices that validation enforces."""
    meta = {"min": min, "max": max, "choices": tuple(choices) if choices else None}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(kw_only=True)
class ModelConfig:
    name: str = "mlp"
    """Registered model name (``mlp``) or an import path ``package.module:Name``."""
    options: dict = _opt({})
    """Keyword arguments for the model adapter, e.g. ``{hidden: [128]}`` for ``mlp``."""
    sync_batchnorm: bool = False
    """Synchronize batch normalization across ranks: each batch-norm layer normalizes with the mean
    and variance of the global batch, not of the rank's share (Horovod's ``SyncBatchNorm`` in
    PyTorch; :mod:`hvdtrain.tensorflow.syncbn` in Keras). Costs one allreduce per layer per step."""
    activation_checkpointing: bool = False
    """Recompute each unit's activations in the backward pass instead of keeping them
    (``torch.utils.checkpoint`` per unit, the units those of ``shard.unit_kib``; in TensorFlow
    ``tf.recompute_grad`` per layer of ``model.layers``): less memory for one more forward
    pass."""


@dataclass(kw_only=True)
class DataConfig:
    name: str = "digits"
    """Registered dataset name (``digits``) or an import path ``package.module:Name``."""
    options: dict = _opt({})
    """Keyword arguments for the dataset."""
    batch_size: int = _opt(32, min=1)
    """Samples per rank per micro-batch; the global batch is this times the world size."""
    eval_batch_size: int = _opt(256, min=1)
    """Samples per rank per evaluation batch."""
    shuffle: bool = True
    """Shuffle the training samples every epoch (from ``seed`` and the epoch number)."""
    workers: int = _opt(-1, min=-1)
    """Loader workers per rank for data on disk: PyTorch ``DataLoader`` processes, ``tf.data``
    parallel calls (0: load on the training thread; -1: half the cores the rank has, 1 to 8, see
    ``hvdtrain.data.loading.loader_workers``). Data in memory is always gathered on the training
    thread. Which samples a step trains on, in what order, does not depend on it."""
    prefetch: int = _opt(2, min=1)
    """Micro-batches each loader worker keeps ready ahead of training (PyTorch's
    ``prefetch_factor``; ``tf.data`` prefetches ``workers x prefetch``); refused with
    ``workers: 0``."""


def check_data_unread(data: DataConfig) -> None:
    """``data.prefetch`` with no loader worker to prefetch, as a one-line error. (``workers`` and
    ``prefetch`` with data in memory are accepted: the data set decides that when it is built on
    each rank, which the config cannot see; docs/configuration.md.)"""
    if data.workers == 0:
        refuse_unread("data.", data, ["prefetch"], "data.workers=0", "the batches are gathered "
                      "on the training thread, and no loader worker prefetches",
                      "data.workers to 1 or more (-1: half the rank's cores)")


@dataclass(kw_only=True)
class TrainConfig:
    epochs: int = _opt(10, min=1)
    """Passes over the training split."""
    max_steps: int = _opt(0, min=0)
    """Stop after this many optimizer steps in all (0: no limit)."""
    backward_passes_per_step: int = _opt(1, min=1)
    """Micro-batches accumulated locally before each allreduce and optimizer step."""
    threads: int = _opt(0, min=0)
    """Compute threads per rank (0: the machine's cores divided by the ranks on this host, at
    most the cores the rank may run on, see ``hvdtrain.horovod_start.compute_threads``)."""
    eval_every_epochs: int = _opt(1, min=1)
    """Evaluate on the test split every this many epochs (and always after the last)."""
    stall_timeout_s: float = _opt(300.0, min=0.0, max=1e6)
    """When a rank finishes no step or evaluation for this long, it writes its stacks to
    ``stacks-rank<r>.txt`` in the run directory and exits, so a hung job fails (0: never; at most
    1e6, about 11 days: Python's timers refuse much more)."""
    device: str = _opt("auto", choices=DEVICES)
    """Where each rank computes: ``auto`` (a GPU when one is visible, else the CPU), ``cpu``, or
    ``cuda`` (an error before anything starts when no GPU is visible). One rank per GPU, picked
    by local rank (see :mod:`hvdtrain.device`)."""
    precision: str = _opt("fp32", choices=PRECISIONS)
    """Arithmetic of the forward and backward passes: ``fp32``, ``bf16`` (autocast / Keras mixed
    policy, CPU and GPU) or ``fp16`` (the same with loss scaling); weights, optimizer state and
    the gradient exchange stay float32 (see :mod:`hvdtrain.precision`)."""
    loss_scale: float = _opt(0.0, min=0.0)
    """``fp16``: the loss scale the run starts from, a power of two (0: the framework's, 2**16 for
    PyTorch's ``GradScaler``, 2**15 for Keras's ``LossScaleOptimizer``); halved at each step
    whose gradients overflow (the step is skipped), doubled after 2,000 steps without."""
    slow_rank: int = _opt(-1, min=-1)
    """Slow this rank down on purpose by ``slow_ms`` per step (-1: none): a straggler for
    experiments, such as ``ps.consistency=asp`` against ``bsp`` (docs/parameter-servers.md)."""
    slow_ms: float = _opt(0.0, min=0.0, max=1e6)
    """Milliseconds ``slow_rank`` sleeps in every step, inside the step's time (each of the two
    is refused without the other)."""


def check_train_unread(train: TrainConfig) -> None:
    """``train.slow_ms`` without ``slow_rank``, and the reverse, and ``train.loss_scale``
    without fp16 or not a power of two, as one-line errors."""
    if train.precision != "fp16":
        refuse_unread("train.", train, ["loss_scale"], f"train.precision={train.precision!r}",
                      "only fp16 scales the loss", "train.precision=fp16")
    elif train.loss_scale and math.frexp(train.loss_scale)[0] != 0.5:
        raise ConfigError(f"train.loss_scale={train.loss_scale:g}: the loss scale must be a power "
                          "of two (unscaling is then exact), e.g. 65536; or 0 for the framework's")
    if train.slow_rank < 0:
        refuse_unread("train.", train, ["slow_ms"], "train.slow_rank=-1", "no rank is slowed",
                      "train.slow_rank to the rank to slow")
    elif train.slow_ms == 0:
        refuse_unread("train.", train, ["slow_rank"], "train.slow_ms=0.0", "the rank would "
                      "sleep 0 ms a step", "train.slow_ms")


@dataclass(kw_only=True)
class OptimConfig:
    name: str = _opt("sgd", choices=("sgd", "adam", "adamw"))
    """Optimizer."""
    lr: float = _opt(0.05, min=0.0)
    """Learning rate for one rank; multiplied by the world size when ``scale_lr`` is on."""
    momentum: float = _opt(0.9, min=0.0, max=1.0)
    """SGD momentum (Adam and AdamW have none: refused with them unless left at 0.9)."""
    weight_decay: float = _opt(0.0, min=0.0)
    """L2 weight decay."""
    scale_lr: bool = True
    """Multiply ``lr`` by the world size, as the global batch grows with it (Goyal et al., 2017)."""
    warmup_steps: int = _opt(0, min=0)
    """Steps of linear warm-up from ``lr`` to the scaled learning rate (0: none; needs
    ``scale_lr``, without which the two rates are the same)."""
    schedule: str = _opt("constant", choices=("constant", "cosine"))
    """Learning-rate shape after warm-up."""
    clip_norm: float = _opt(0.0, min=0.0)
    """Clip the step's averaged gradient to at most this global L2 norm before the update, as
    ``torch.nn.utils.clip_grad_norm_`` does (0: off). Under ``shard.stage`` >= 1 the norm is
    summed over the shards (one allreduce of a scalar). On the ring's dense exchange and sharded
    data parallel (in TensorFlow without fp16 loss scaling); refused elsewhere
    (docs/sharding.md)."""

    def __post_init__(self) -> None:
        # Settings that would do nothing are refused, not ignored (as check_comm does for comm).
        if self.name != "sgd" and self.momentum != 0.9:
            raise ConfigError(f"optim.momentum={self.momentum:g} does nothing with optim.name="
                              f"{self.name!r}: only SGD has momentum (Adam's betas are fixed at "
                              "0.9 and 0.999); leave it at its default 0.9")
        if self.warmup_steps and not self.scale_lr:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps} does nothing with "
                              "optim.scale_lr=false: the warm-up rises from optim.lr to the scaled "
                              "rate, which is optim.lr itself; set optim.warmup_steps=0")


BF16_REFUSED = ("comm.compression='bf16': Horovod 0.28.1 cannot carry it: its PyTorch ops refuse "
                "torch.bfloat16 ('Tensor type torch.BFloat16Tensor is not supported', Gloo and "
                "MPI, checked on CPU); use fp16")


@dataclass(kw_only=True)
class CommConfig:
    compression: str = _opt("none", choices=METHODS)
    """Gradient compression on the wire: ``none``, ``fp16`` (Horovod's), ``topk`` and ``randomk``
    (sparsification), ``qsgd`` (8-bit stochastic quantization) or ``powersgd`` (low rank)."""
    ratio: float = _opt(0.01, max=1.0)
    """Fraction of each tensor's entries that ``topk`` and ``randomk`` send, in (0, 1]."""
    error_feedback: bool = True
    """Keep what compression dropped and add it to the next step's gradient (``topk``,
    ``randomk``, ``powersgd``); without it top-k converges poorly."""
    rank: int = _opt(2, min=1)
    """Rank of PowerSGD's low-rank approximation."""
    min_size: int = _opt(1024, min=0)
    """Tensors with fewer elements (biases, small layers) travel uncompressed, as fp32."""
    bucket: int = _opt(512, min=0)
    """``qsgd``: one scale per bucket of this many consecutive elements (0: one per tensor)."""
    momentum_correction: bool = False
    """``topk`` and ``randomk`` with SGD momentum: Deep Gradient Compression's momentum
    correction. The residual accumulates each rank's velocity, not its gradient, and the exchange
    applies the momentum, so the optimizer becomes plain SGD (needs ``error_feedback`` and
    ``optim.momentum`` > 0; refused where it would not run, :mod:`hvdtrain.strategies.comm`).
    Off by default: over 5 seeds at convergence on the MNIST-1D CNN it gained nothing over plain
    error feedback (docs/benchmarks.md)."""
    momentum_masking: bool = False
    """With ``momentum_correction``: clear a rank's velocity where it sent entries (DGC's
    momentum factor masking). Off by default: it cost accuracy on the MNIST-1D CNN
    (docs/benchmarks.md)."""
    clip_norm: float = _opt(0.0, min=0.0)
    """With ``momentum_correction``: DGC's local gradient clipping, each rank's gradient to a
    global L2 norm of at most ``clip_norm / sqrt(ranks)`` before its velocity (0: off)."""
    sparsity_warmup_steps: int = _opt(250, min=0)
    """With ``momentum_correction``: DGC's density warm-up, sending 25%, 6.25%, 1.56%, ... of the
    entries in equal stages over the first this many steps, down to ``ratio`` (0: off)."""
    compress_momentum: bool = False
    """``topk``, ``randomk`` and ``qsgd`` with Adam or AdamW (off by default until
    measured over seeds in a real run, docs/benchmarks.md): 1-bit Adam's design. Dense
    Adam for ``dense_steps``, then the variance freezes and each rank sends its compressed
    momentum with error feedback; the optimizer becomes plain SGD applying the exchange's update
    (refused where it would not run, :mod:`hvdtrain.strategies.comm`)."""
    dense_steps: int = _opt(-1, min=-1)
    """``topk``, ``randomk``, ``qsgd``, ``powersgd``: the first this many steps average every
    tensor dense (float32), then the method starts, its error feedback and PowerSGD's warm-started
    ``Q`` with it (torch's ``start_powerSGD_iter``); compressed Adam's dense warm-up, and DGC's
    density warm-up begins after it (docs/compression.md, "Dense start"). -1: ``dense_fraction``
    of the run's steps, at least ``dense_min_steps``; 0: none."""
    dense_fraction: float = _opt(0.03, min=0.0, max=1.0)
    """With ``dense_steps: -1``: the dense start as a fraction of the run's optimizer steps
    (``train.epochs`` capped by ``train.max_steps``), rounded up to whole steps, at least
    ``dense_min_steps``. The default is the measured one: of the dense starts that kept top-k 1%
    at 10x fewer bytes over the run on the MNIST-1D CNN, the most accurate (docs/compression.md,
    "Dense start")."""
    dense_min_steps: int = _opt(30, min=0)
    """With ``dense_steps: -1``: the dense start's floor, capped at the run's length, so a short
    run averages dense until training has settled (a run of 30 steps or fewer is all dense).
    From ``dense_min_steps / dense_fraction`` steps on (1,000 with the defaults) the fraction
    alone decides. The default is the largest floor that leaves those runs as they were and
    is above torch's advised 10% at 200 steps (docs/compression.md, "Dense start"; 0: the
    fraction alone)."""
    adaptive: bool = False
    """``topk``, ``randomk``, ``powersgd`` (plain averaging): Accordion's switch between two
    levels. Every ``adaptive_interval`` steps, where the mean gradient norm changed by at least
    ``adaptive_threshold`` of the previous interval's, the next interval sends ``adaptive_factor``
    times more (``ratio`` or ``rank``), else the configured level; the same decision on every rank
    (docs/compression.md, "Adaptive compression")."""
    adaptive_interval: int = _opt(100, min=1)
    """With ``adaptive``: steps per interval of the switch."""
    adaptive_threshold: float = _opt(0.5, min=0.0)
    """With ``adaptive``: the relative change of the interval's gradient norm that counts as a
    critical regime (Accordion's 0.5)."""
    adaptive_factor: int = _opt(4, min=2)
    """With ``adaptive``: how many times more the low compression level sends (Accordion:
    PowerSGD rank 1 against 4, top-k 1% against 4%)."""
    cycle_time_ms: float = _opt(0.0, min=0.0, max=1000.0)
    """How often Horovod's background thread looks for tensors to reduce (``HOROVOD_CYCLE_TIME``).
    0: Horovod's own 1 ms (see :func:`hvdtrain.horovod_start.set_cycle_time`); a
    ``HOROVOD_CYCLE_TIME`` or ``horovodrun --cycle-time-ms`` already set is kept. Read once, when
    Horovod starts in the process. At most 1000 (a second between looks: every allreduce would wait
    that long)."""
    topology: str = _opt("ring", choices=("ring", "ps"))
    """How gradients travel: ``ring`` (Horovod's allreduce among all ranks) or ``ps`` (parameter
    servers, configured in the ``ps`` section; see docs/parameter-servers.md)."""

    def __post_init__(self) -> None:
        # Checked here, before the choices, so that bf16 gets the reason rather than a list.
        if self.compression == "bf16":
            raise ConfigError(BF16_REFUSED)
        if not self.ratio > 0.0:
            raise ConfigError(f"comm.ratio={self.ratio!r}: must be > 0 and <= 1")


PS_PLACEMENTS = ("dedicated",)
PS_CONSISTENCIES = ("bsp", "ssp", "asp")


@dataclass(kw_only=True)
class PSConfig:
    """Parameter servers, used when ``comm.topology=ps`` (docs/parameter-servers.md)."""

    servers: int = _opt(1, min=1)
    """Server processes S. ``dedicated``: the last S ranks of the job serve and the others train,
    so the job needs more than S ranks (launch with ``horovodrun --mpi`` or ``mpirun``)."""
    placement: str = _opt("dedicated", choices=PS_PLACEMENTS)
    """``dedicated``: server processes of their own, NumPy and mpi4py only, beside the workers
    (the only placement: the sharded update that was ``colocated`` is ``shard.stage=1``)."""
    consistency: str = _opt("bsp", choices=PS_CONSISTENCIES)
    """``bsp``: every step waits for all workers; the servers sum the gradients and the workers
    keep their own optimizers, so training equals the ring's. ``ssp`` (bounded staleness) and
    ``asp`` (asynchronous): the servers run the optimizer (``optim``) on their shards, applying
    each worker's push on its own; a worker pulls whatever is current, under ``ssp`` only while it
    is at most ``staleness`` pushes ahead of the slowest (PyTorch only; fp32 or bf16)."""
    staleness: int = _opt(0, min=0)
    """``ssp``: how many steps a worker may run ahead of the slowest (0 with ``bsp`` and ``asp``)."""
    chunk_kib: int = _opt(4096, min=1)
    """Dedicated servers: the flat gradient travels in chunks of at most this many KiB (BytePS's
    partition: 4 MiB), smaller where a gradient would make fewer than 64 (not below 64 KiB), each
    owned by one server picked by hashing its index, so pushes and pulls of chunks overlap
    (:func:`hvdtrain.ps.layout.server_chunk`)."""
    overlap: bool = True
    """Dedicated servers under ``bsp``, PyTorch, a dense wire (``comm.compression`` ``none`` or
    ``fp16``): each chunk leaves as soon as the backward pass has produced all of its gradients,
    the last layers' first, so pushing overlaps the backward pass as the ring's hooks do; false:
    the whole gradient is pushed after the pass."""
    timeout_s: float = _opt(300.0, min=1.0, max=1e6)
    """A worker that waits this long for a server's answer stops the job with an error naming that
    server (dead or hung). A server answers a step once every worker pushed it, so the wait also
    covers the slowest worker's lag: keep it well above a step's time."""

    def __post_init__(self) -> None:
        # Before the choices, so that the old placement gets the new key rather than a list.
        if self.placement == "colocated":
            raise ConfigError(COLOCATED_GONE)


COLOCATED_GONE = ("ps.placement='colocated' is gone: the sharded update is sharded data parallel "
                  "now; set shard.stage=1 (with comm.topology=ring, docs/sharding.md)")
"""The one line that refuses the old key of the sharded update."""


@dataclass(kw_only=True)
class ShardConfig:
    """Sharded data parallel (docs/sharding.md): ZeRO's stages on Horovod's collectives."""

    stage: int = _opt(0, min=0, max=3)
    """0: off (every rank keeps the whole optimizer state). 1: the optimizer state is sharded:
    each step reduce-scatters the flat gradient over a stage's data-parallel copies, every rank
    updates the shard of the parameters it owns, and all-gathers the updated shards back, so a
    rank keeps 1/N of the optimizer state and trains as the ring does. 2: the gradients too, per
    unit of the model, reduce-scattered as the backward pass makes them. 3: the parameters too:
    each unit's are all-gathered before its forward and its backward pass and freed after (in
    TensorFlow a unit is one of ``model.layers``, recomputed in the backward pass)."""
    group: str = _opt("all", choices=("all", "node"))
    """The ranks that shard the model. ``all``: a stage's data-parallel copies (every rank
    without pipeline stages). ``node``: the ranks of one node (Horovod's ``local_size``), each
    node holding a replica of the sharded model (FSDP's hybrid sharding, ZeRO++'s hpZ): the
    reduce-scatter and the all-gather stay within the node, and only each shard's gradient is
    averaged across nodes (PyTorch)."""
    chunk_kib: int = _opt(4096, min=1)
    """``shard.stage=1``: the KiB per rank of each round of the reduce-scatter and the
    all-gather, so that no collective holds a second copy of the whole gradient, and of each
    piece of the shard the optimizer steps in turn (its temporaries are a piece's size). In
    TensorFlow an all-gather round is a group of whole variables up to that size."""
    unit_kib: int = _opt(65536, min=1)
    """``shard.stage`` 2 and 3 (and ``model.activation_checkpointing``): a model that is not a
    ``Sequential`` of the adapter's layers is cut into units by descending into its modules
    until one holds at most this many KiB of parameters; a ``Sequential``'s units are its
    layers, a layer of more than this many KiB cut the same way (stage 3 holds a few units
    gathered at once beside its shards)."""
    piece_kib: int = _opt(0, min=0)
    """``shard.stage`` 2 and 3 (PyTorch): each unit's all-gathers and reduce-scatters run as
    rounds of at most this many KiB per rank, one after another (0: one collective a unit). On
    the namespace cluster's 100 Mbit/s links one large Gloo all-gather ran at half the link's
    rate and 128 KiB rounds at the rate (docs/sharding.md, "Slow links"); each round costs a
    Horovod cycle, and only the first overlaps computation. (Stage 1: ``shard.chunk_kib``.)"""
    prefetch: int = _opt(1, min=0)
    """``shard.stage=3``: how many units ahead the all-gather of parameters starts while a unit
    computes (0: each unit waits for its own)."""
    reshard_after_forward: bool = True
    """``shard.stage=3``: free a unit's gathered parameters after its forward pass (and gather
    them again before its backward pass); false keeps them until the unit's backward pass, as
    stage 2 does, trading memory for one all-gather less."""


def check_shard(shard: ShardConfig, model: ModelConfig) -> None:
    """The ``shard`` settings that would do nothing, as a one-line error (where the sharded
    update cannot run is in the compatibility table, :mod:`hvdtrain.strategies.shard`)."""
    if shard.stage == 0:
        refuse_unread("shard.", shard, ["group"], "shard.stage=0",
                      "only the sharded update has a shard group", "shard.stage=1, 2 or 3")
    if shard.stage != 1:
        refuse_unread("shard.", shard, ["chunk_kib"], f"shard.stage={shard.stage}",
                      "only the sharded update reads it" if shard.stage == 0
                      else "only stage 1's rounds read it", "shard.stage=1")
    if shard.stage < 2:
        refuse_unread("shard.", shard, ["piece_kib"], f"shard.stage={shard.stage}",
                      "only the units of stages 2 and 3 travel in pieces (stage 1's rounds: "
                      "shard.chunk_kib)", "shard.stage=2 or 3")
    if shard.stage < 2 and not model.activation_checkpointing:
        refuse_unread("shard.", shard, ["unit_kib"], f"shard.stage={shard.stage}",
                      "units are cut at stages 2 and 3 or for activation checkpointing",
                      "shard.stage=2 or 3")
    if shard.stage != 3:
        refuse_unread("shard.", shard, ["prefetch", "reshard_after_forward"],
                      f"shard.stage={shard.stage}", "only stage 3 gathers parameters",
                      "shard.stage=3")


def check_clip(cfg: Config) -> None:
    """``optim.clip_norm`` where the update it clips is not built, as one line."""
    if not cfg.optim.clip_norm:
        return
    # TensorFlow's fp16 gradients reach the update scaled: the LossScaleOptimizer unscales later.
    where = (["train.precision='fp16' and framework='tensorflow'"]
             if cfg.framework == "tensorflow" and cfg.train.precision == "fp16" else [])
    where += [f"comm.compression={cfg.comm.compression!r}"] * (cfg.comm.compression
                                                               not in ("none", "fp16"))
    where += [f"comm.topology={cfg.comm.topology!r}"] * (cfg.comm.topology != "ring")
    where += [f"pipeline.stages={cfg.pipeline.stages}"] * (cfg.pipeline.stages > 1)
    if where:
        raise ConfigError(f"optim.clip_norm={cfg.optim.clip_norm:g} with {where[0]}: clipping by "
                          "global norm is built for the ring (comm.compression none or fp16) and "
                          "shard.stage only, in TensorFlow without fp16 loss scaling; leave "
                          "optim.clip_norm at its default 0")


@dataclass(kw_only=True)
class PipelineConfig:
    stages: int = _opt(1, min=1)
    """Pipeline stages ``P``: the model is cut into ``P`` consecutive pieces, each held by one rank,
    and the world's ranks form ``world size / P`` data-parallel copies of that pipeline (the world
    size must be a multiple of ``P``). 1: every rank holds the whole model (no pipeline). See
    docs/pipeline.md."""
    microbatches: int = _opt(0, min=0)
    """Micro-batches ``m`` each step's batch of one pipeline copy is split into, so that the stages
    overlap (0: ``stages x virtual_stages``). With stages, ``data.batch_size`` (and
    ``eval_batch_size``) is the batch of one pipeline copy and must be a multiple of ``m``."""
    schedule: str = _opt("1f1b", choices=SCHEDULE_NAMES)
    """Order of the micro-batches' forward and backward passes: ``1f1b`` (at most ``P``
    micro-batches in flight; ``m >= P``), ``gpipe`` (all forwards, then all backwards),
    ``interleaved_1f1b`` (``virtual_stages`` pieces per rank: a smaller bubble for more traffic);
    PyTorch only and experimental: ``interleaved_zero_bubble``; ``zbv_zero_bubble`` and
    ``dualpipev`` are refused with stages (torch 2.13 cannot evaluate with them)."""
    virtual_stages: int = _opt(1, min=1)
    """Model pieces per rank (``v``): 1, except for the interleaved and zero-bubble schedules."""
    split: str | list = "auto"
    """Where the pieces begin: ``auto`` balances their parameter counts; or a list of the
    ``P x v - 1`` layers (indices into the model's layer list, or layer names) where the pieces
    after the first begin."""


@dataclass(kw_only=True)
class CheckpointConfig:
    enabled: bool = True
    """Write checkpoints (rank 0 only)."""
    every_steps: int = _opt(0, min=0)
    """Checkpoint every this many optimizer steps (0: only at the end)."""
    keep: int = _opt(3, min=1)
    """Keep the newest this many checkpoints."""
    resume: str = "none"
    """``none``: start afresh; ``auto``: continue from the newest valid checkpoint in the run
    directory, if there is one; or the path of a checkpoint file to continue from."""


def check_checkpoint_unread(checkpoint: CheckpointConfig) -> None:
    """``every_steps`` and ``keep`` with checkpoints off, as a one-line error (``resume`` is read
    either way: it loads a checkpoint, and writing them is what ``enabled`` turns off)."""
    if not checkpoint.enabled:
        refuse_unread("checkpoint.", checkpoint, ["every_steps", "keep"],
                      "checkpoint.enabled=false", "no checkpoint is written",
                      "checkpoint.enabled=true")


@dataclass(kw_only=True)
class ElasticConfig:
    enabled: bool = False
    """Train under ``hvd.elastic.run``: survive workers that die or join (launch with
    ``horovodrun --min-np/--max-np --host-discovery-script``; Gloo only)."""
    commit_every: int = _opt(10, min=1)
    """Commit the training state in memory every this many steps: a lost worker costs at most
    this many steps."""
    on_resize: str = _opt("scale_lr", choices=("scale_lr", "keep_global_batch"))
    """After workers leave or join: ``scale_lr`` keeps the per-rank batch and scales the learning
    rate with the new world size (``optim.scale_lr``); ``keep_global_batch`` keeps the global batch
    and the learning rate of the starting world size by changing local accumulation."""
    record_indices: bool = False
    """Write the sample indices trained on, per epoch, to ``indices/epoch-<e>.npy`` in the run
    directory (committed steps only), to check that each sample was used exactly once."""


def check_elastic_unread(elastic: ElasticConfig) -> None:
    """The ``elastic`` settings with elastic mode off, as a one-line error."""
    if not elastic.enabled:
        refuse_unread("elastic.", elastic, ["commit_every", "on_resize", "record_indices"],
                      "elastic.enabled=false", "only elastic mode commits, resizes and records "
                      "indices", "elastic.enabled=true")


@dataclass(kw_only=True)
class LogConfig:
    dir: str = ""
    """Run directory (default ``runs/<name>``)."""
    every_steps: int = _opt(10, min=1)
    """Log averaged training metrics every this many optimizer steps."""
    console: bool = True
    """Print progress to the console (rank 0)."""
    console_every_s: float = _opt(1.0, min=0.0)
    """Show a record on the console at most this often (seconds of run time; 0: every record);
    records with an evaluation or an event (a straggler) and the last step are always shown."""
    overwrite: bool = False
    """Replace the files of an earlier run in the same directory (otherwise that is an error)."""
    tensorboard: bool = True
    """Write TensorBoard event files into the run directory (rank 0)."""
    wandb: str = _opt("offline", choices=("offline", "online", "disabled"))
    """Weights & Biases: ``offline`` writes a run to sync later, ``online`` needs WANDB_API_KEY."""
    wandb_project: str = "hvdtrain"
    """W&B project name."""
    dashboard_every_s: float = _opt(1.0, min=0.0)
    """Hand TensorBoard and W&B a record at most this often (seconds of run time; 0: every record);
    records with an evaluation or an event and the last step always go. ``metrics.jsonl`` gets
    every record. Each record costs the writer process CPU time (W&B advises under one ``log``
    call a second), which training pays for where every core trains."""
    jsonl: bool = True
    """Write ``metrics.jsonl`` (rank 0); ``hvdtrain report`` and resuming read it."""
    jsonl_every_s: float = _opt(1.0, min=0.0)
    """Append the records held for ``metrics.jsonl`` at most this often (seconds; 0: each record as
    it comes). Every record is kept; they are also written before each checkpoint and elastic
    commit, at a stall and at the end, so only a rank 0 killed outright loses the last second."""
    progress: str = _opt("auto", choices=("auto", "bar", "lines"))
    """Console style: ``bar`` (one line redrawn in place), ``lines`` (one line per log, for CI and
    Slurm logs), ``auto`` (the bar when stdout is a terminal; under ``horovodrun`` it is a pipe)."""
    system: bool = True
    """Log CPU utilisation and resident memory per rank, and GPU utilisation and memory via NVML
    where a GPU and ``pynvml`` are present (sampled once per log interval)."""
    straggler_factor: float = _opt(1.5, min=1.0)
    """A rank whose step time (less its wait for other ranks) exceeds the median of the other ranks
    (with pipeline stages: of its stage's other copies) by this factor for ``straggler_steps``
    consecutive logs is reported as a straggler."""
    straggler_steps: int = _opt(3, min=1)
    """Consecutive logs a rank must be slow before it is reported."""


def check_log_unread(log: LogConfig) -> None:
    """The ``log`` settings of a sink that is off, as one-line errors."""
    if not log.console:
        refuse_unread("log.", log, ["console_every_s", "progress"], "log.console=false",
                      "nothing is printed", "log.console=true")
    if not log.jsonl:
        refuse_unread("log.", log, ["jsonl_every_s"], "log.jsonl=false", "metrics.jsonl is not "
                      "written", "log.jsonl=true")
    if log.wandb == "disabled":
        refuse_unread("log.", log, ["wandb_project"], "log.wandb='disabled'", "no W&B run is "
                      "made", "log.wandb=offline")
        if not log.tensorboard:
            refuse_unread("log.", log, ["dashboard_every_s"],
                          "log.tensorboard=false and log.wandb='disabled'",
                          "no dashboard takes records", "log.tensorboard=true")


@dataclass(kw_only=True)
class Config:
    name: str = "run"
    """Run name; the default run directory is ``runs/<name>``."""
    framework: str = _opt("torch", choices=("torch", "tensorflow"))
    """Which engine trains the model."""
    seed: int = _opt(0, min=0)
    """Base seed: rank r seeds its generators with ``seed + r``; shuffling uses ``seed`` alone. At
    most 2**31 - 1, as every integer key (:data:`hvdtrain.configcheck.INT_MAX`)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        # The sections are built and range-checked by now; what spans sections is checked here.
        check_pipeline_section(self)
        check_ps(self.ps)
        check_shard(self.shard, self.model)
        if self.framework == "tensorflow":
            refuse_unread("shard.", self.shard, ["piece_kib"], "framework='tensorflow'",
                          "TensorFlow's units gather and scatter whole", "framework='torch'")
        check_clip(self)
        check_strategies(self)  # what the strategies do not compose with: the one table
        check_comm(self.comm, self.optim)  # every comm setting that would do nothing, refused
        # The other settings that would do nothing (the pipeline's: in check_pipeline_section).
        check_data_unread(self.data)
        check_train_unread(self.train)
        check_ps_unread(self)
        check_checkpoint_unread(self.checkpoint)
        check_elastic_unread(self.elastic)
        check_log_unread(self.log)

    @property
    def run_dir(self) -> Path:
        """Where this run writes its outputs."""
        return Path(self.log.dir or f"runs/{self.name}")

    def to_dict(self) -> dict:
        """The resolved config as plain data, ready for YAML."""
        return dataclasses.asdict(self)


ENV_PREFIX = "HVDTRAIN_"


def env_overrides(environ: Mapping[str, str]) -> list[str]:
    """Turns ``HVDTRAIN_TRAIN__EPOCHS=3`` into the override ``train.epochs=3``."""
    out = []
    for key, value in sorted(environ.items()):
        if key.startswith(ENV_PREFIX) and "__" in key:
            dotted = key[len(ENV_PREFIX):].lower().replace("__", ".")
            out.append(f"{dotted}={value}")
    return out


def _set_dotted(tree: dict, dotted: str, raw: str) -> None:
    """Sets ``tree[a][b] = value`` for ``a.b``; the value is parsed as YAML (``0.1``, ``[64]``)."""
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        if node.get(part) is None:  # absent, or an empty section in the YAML
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: cannot set a key inside a {type(node).__name__}")
    try:
        node[leaf] = yaml.safe_load(raw) if raw != "" else ""
    except (yaml.YAMLError, ValueError):  # ValueError: a date YAML cannot build (2024-13-01)
        node[leaf] = raw


def apply_overrides(tree: dict, overrides: Sequence[str]) -> dict:
    """Applies ``key.sub=value`` overrides to a raw config tree."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. train.epochs=3")
        _set_dotted(tree, key.strip(), raw.strip())
    return tree


def build(cls: type, tree: Any, prefix: str = "") -> Any:
    """Builds dataclass ``cls`` from a raw tree, checking every key, type and range."""
    if not isinstance(tree, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}={shown(tree)}: "
                          "expected a mapping of keys")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    types = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(RETIRED_KEYS.get(path)
                              or f"unknown key {shown(path)}{nearest_key(str(key), fields, prefix)}")
        ftype = types[key]
        if isinstance(ftype, type) and dataclasses.is_dataclass(ftype):
            kwargs[key] = build(ftype, {} if value is None else value, f"{path}.")
        else:
            kwargs[key] = coerce_value(path, value, ftype)
    obj = cls(**kwargs)
    check_section(obj, prefix)
    return obj


def load_config(path: str | Path | None, overrides: Sequence[str] = (),
                environ: Mapping[str, str] | None = None) -> Config:
    """Reads the YAML file, applies environment and command-line overrides, and validates."""
    tree: Any = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found")
        tree = _read_yaml(path)
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: expected a mapping of keys at the top, "
                              f"got {type(tree).__name__}")
    environ = os.environ if environ is None else environ
    apply_overrides(tree, [*env_overrides(environ), *overrides])
    return build(Config, tree)


def _read_yaml(path: Path) -> Any:
    """The YAML document of the config file, or a one-line error naming the file."""
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({exc.reason} at byte "
                          f"{exc.start})") from None
    except OSError as exc:
        raise os_failure(exc, "cannot read the config file", path,
                         "check its permissions") from None
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    except (ValueError, RecursionError) as exc:  # a date that does not exist, or absurd nesting
        raise ConfigError(f"{path}: not a valid config ({str(exc).splitlines()[0]})") from None


def save_config(cfg: Config, path: Path) -> None:
    """Writes the resolved config as YAML."""
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
