"""The pieces of a PyTorch pipeline stage that do not need the engine: Horovod process sets, the
``torch.distributed`` rendezvous and groups, building a rank's pieces from the layer list,
fixed-shape padding, the count of saved activations, and the stage's gradient exchange (an
allreduce, a compressing method, or ``shard.stage=1``'s sharded update among the stage's copies;
see :mod:`hvdtrain.torch.pipeline`)."""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import horovod.torch as hvd
import torch
import torch.distributed as dist
from torch import nn

from hvdtrain.data import tree
from hvdtrain.driver import launcher_host
from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import (
    Exchanged,
    ExchangeRequest,
    GradientExchange,
    build_exchange,
    empty_stats,
    exchange_kind,
)
from hvdtrain.layout import Layout
from hvdtrain.ps.layout import chunk_elements
from hvdtrain.torch.collectives import TorchCollectives, any_rank, process_set
from hvdtrain.torch.compression import make_compressing, optimizer_settings, with_optimizer
from hvdtrain.torch.exchange import horovod_compression
from hvdtrain.torch.shard import make_sharded
from hvdtrain.torch.shard_units import make_unit_sharded
from hvdtrain.torch.units import UNIT, Unit


def stage_process_set(ranks: Sequence[int]) -> Any:
    """Horovod's process set of ``ranks``; every rank must ask for every set in the same order
    (:func:`hvdtrain.torch.collectives.process_set`, which shard.group=node's sets share)."""
    return process_set(ranks)


def rendezvous_address(collectives: TorchCollectives) -> str:
    """Rank 0's address as the other ranks can reach it: the loopback where every rank shares
    its host, else the address of rank 0's route towards another rank's host (``gethostbyname``
    of the own host name may give 127.0.x.1, which no other host reaches). A collective."""
    hosts = collectives.allgather_object(launcher_host(os.environ))
    if collectives.rank() != 0:
        return ""
    others = [h for h in hosts if h != hosts[0]]
    if not others:
        return "127.0.0.1"
    try:
        peer = socket.gethostbyname(others[0])
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((peer, 9))  # UDP: no packet is sent; the kernel picks the route
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise HvdtrainError(f"pipeline stages: cannot find rank 0's address towards host "
                            f"{others[0]!r} ({exc})") from None


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def start_torch_distributed(collectives: TorchCollectives, device: torch.device,
                            timeout_s: float) -> None:
    """Starts ``torch.distributed`` over every rank (ranks as Horovod's), at an address rank 0
    chose and Horovod's broadcast handed out; once per process. ``timeout_s`` bounds a wait for
    another stage, so a lost rank ends the job instead of hanging it (0: torch's default)."""
    if dist.is_initialized():
        return
    address = rendezvous_address(collectives)
    if collectives.rank() == 0:
        address = f"tcp://{address}:{free_port()}"
    address = collectives.broadcast_object(address)
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s > 0 else None
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=address,
                            rank=collectives.rank(), world_size=collectives.size(),
                            timeout=timeout)


def pipeline_groups(layout: Layout, rank: int) -> Any:
    """This rank's pipeline process group (every rank creates every copy's, in order)."""
    mine = None
    for ranks in layout.pipelines():
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def describe_layers(factories: Sequence[Any]
                    ) -> tuple[list[int], list[str], list[str], list[str]]:
    """Each layer's parameter count, and the global names of every parameter, of every entry of
    the whole model's ``state_dict`` and of the parameters that train (the exchange's tensors)
    (``"<layer>.<name>"``, in the whole model's order), from each layer built on the meta device
    (no memory, no random numbers)."""
    costs, params, keys, trainable = [], [], [], []
    for index, make in enumerate(factories):
        with torch.device("meta"):
            layer = make()
        if not isinstance(layer, nn.Module):
            raise HvdtrainError(f"layer {index} of the model is a {type(layer).__name__}, not a "
                                "torch.nn.Module")
        costs.append(sum(p.numel() for p in layer.parameters()))
        params += [f"{index}.{name}" for name, _ in layer.named_parameters()]
        keys += [f"{index}.{name}" for name in layer.state_dict()]
        trainable += [f"{index}.{name}" for name, p in layer.named_parameters() if p.requires_grad]
        del layer
    return costs, params, keys, trainable


def build_pieces(factories: Sequence[Any], bounds: Sequence[int], mine: Sequence[int],
                 seed: int, shard: tuple[int, int] | None = None) -> dict[int, nn.Sequential]:
    """This rank's pieces, each an ``nn.Sequential`` whose children are named by their global
    layer index (so a piece's ``state_dict`` keys are the whole ``Sequential``'s).

    Every layer is made in order under ``seed``, as the whole model would be, and the other
    pieces' layers dropped at once: the rank's layers start from the whole model's values,
    whatever the split, and no other layer outlives its own construction. ``shard``
    (``shard.stage=3``: this copy and the stage's copies): each own layer is cut to this copy's
    shard as soon as it exists (:func:`hvdtrain.torch.units.build_by_units`' way), so that no
    rank holds even its stage whole.
    """
    torch.manual_seed(seed)
    owner = {i: piece for piece in mine for i in range(bounds[piece], bounds[piece + 1])}
    layers: dict[int, list[tuple[str, nn.Module]]] = {piece: [] for piece in mine}
    for index, make in enumerate(factories):
        layer = make()
        if index in owner:
            params = [p for p in layer.parameters() if p.requires_grad]
            if shard is not None and params:
                unit = Unit(-1, layer, params, *shard)
                unit.free()
                setattr(layer, UNIT, unit)
            layers[owner[index]].append((str(index), layer))
        del layer
    return {piece: nn.Sequential(OrderedDict(named)) for piece, named in layers.items()}


def layers_of(modules: dict[int, nn.Sequential]) -> nn.Sequential:
    """This rank's layers, in its pieces' order, as one ``Sequential`` named by global index:
    the units of ``shard.stage`` 2-3 (never called: the pieces run the layers), whose
    ``state_dict`` is the pieces' own, keys and parameter order alike."""
    return nn.Sequential(OrderedDict((name, layer) for module in modules.values()
                                     for name, layer in module.named_children()))


def pad_rows(batch: Any, rows: int) -> Any:
    """``batch`` (a tree of tensors) with ``rows`` rows: its own rows repeated in order, or zeros
    where it has none; fixed shapes for the pipeline."""
    def pad(t: torch.Tensor) -> torch.Tensor:
        have = t.shape[0]
        if have == rows:
            return t
        if have == 0:
            return t.new_zeros((rows, *t.shape[1:]))
        return t[torch.arange(rows, device=t.device) % have]
    return tree.map_tree(pad, batch)


class SavedActivations:
    """The bytes autograd holds for backward passes still to come (what the forward passes saved),
    counted through ``torch.autograd.graph.saved_tensors_hooks`` while a schedule runs, and their
    peak: the activation memory that 1F1B bounds to ``P`` micro-batches on the first stage and
    GPipe does not. It counts tensors, not the allocator's cache (which resident memory includes):
    a tensor saved by several operations counts once, and parameters do not count."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}
        """(Address, bytes) of a saved tensor -> [bytes, saved references still held]."""
        self.current = self.peak = 0

    def hooks(self) -> Any:
        """The context in which autograd's saved tensors are counted; the peak restarts."""
        self.peak = self.current
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        base = tensor if tensor._base is None else tensor._base  # a weight saved transposed
        if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad):
            return tensor
        # By the tensor's own bytes, not its storage's: a micro-batch is a view of its batch.
        size = tensor.numel() * tensor.element_size()
        key = hash((tensor.data_ptr(), size))
        entry = self.live.setdefault(key, [size, 0])
        if entry[1] == 0:
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        return _Saved(tensor, key, self)

    def release(self, key: int) -> None:
        """One saved reference to tensor ``key`` is gone (autograd freed its node)."""
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]


class _Saved:
    """A saved tensor as autograd keeps it between the forward and the backward pass; freed with
    its graph node, which tells the count."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int, meter: SavedActivations) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter.release(self.key)


def _unpack(saved: Any) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Saved) else saved


class StageAllreduce(GradientExchange):
    """A pipeline stage's gradient exchange: Horovod's average over that stage's copies, in
    their process set (nothing to send with one copy). ``comm.compression`` ``fp16`` applies."""

    def __init__(self, process_set: Any, rank: int, size: int, method: str) -> None:
        self.process_set, self.rank, self.size = process_set, rank, size
        self.compression = horovod_compression(method)
        self.stats = empty_stats()

    def run(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self.process_set is None:
            self.stats = empty_stats()
            return list(grads)
        waited = time.perf_counter()
        averaged = hvd.grouped_allreduce(list(grads), op=hvd.Average, name="hvdtrain.stage",
                                         compression=self.compression,
                                         process_set=self.process_set)
        dense = float(sum(g.numel() * g.element_size() for g in grads))
        wire = dense / 2 if self.compression is hvd.Compression.fp16 else dense
        self.stats = {"wire_bytes": wire, "dense_bytes": dense,
                      "comm_s": time.perf_counter() - waited, "compress_s": 0.0}
        return list(averaged)

    def any_rank(self, flag: bool) -> bool:
        return flag if self.process_set is None else any_rank(flag, self.process_set)

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        raise HvdtrainError("pipeline stages do not resize (elastic mode is refused with them)")


def stage_sets(layout: Layout, cfg: Any) -> list[Any]:
    """Horovod's process set of each stage's copies, by stage (every rank adds every set, in
    order). With one copy a dense exchange sends nothing and needs none (None); a compressing
    one still runs its plan (error feedback, an update rule), in a set of its one rank."""
    if layout.copies == 1 and exchange_kind(cfg) == "dense":
        return [None] * layout.stages
    return [stage_process_set(ranks) for ranks in layout.stage_groups()]


def make_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Makes a fresh optimizer's state as Horovod's ``broadcast_optimizer_state`` does on the ring
    (:meth:`hvdtrain.torch.engine.TorchEngine.broadcast_state`): one step with zero gradients at
    the optimizer's initial rate. That step is not a no-op: Adam's step count starts at 1 (so its
    first real update's bias correction is the ring's), and weight decay changes the weights once
    (and SGD's momentum). A stage must take it too to train as the ring does. Nothing where the
    optimizer already has state (a restored checkpoint's)."""
    if optimizer.state_dict()["state"]:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in params:
        p.grad = None


def make_stage_exchange(cfg: Any, request: ExchangeRequest) -> Exchanged:
    """The exchange over this rank's stage's gradients among the stage's copies
    (``request.process_set``; ``rank`` and ``size``: this copy and the copies) and the optimizer
    the step drives with it, built by the ``torch.stage`` factory the strategies' registry names
    for ``cfg`` (:func:`hvdtrain.exchange.build_exchange`), as :func:`hvdtrain.torch.exchange.
    make_exchange` builds a whole model's."""
    return build_exchange(cfg, request, stage=True)


def stage_allreduce(r: ExchangeRequest) -> Exchanged:
    """``dense`` among a stage's copies: Horovod's allreduce in their process set."""
    return StageAllreduce(r.process_set, r.rank, r.size, r.comm.compression), r.optimizer


def stage_compressing(r: ExchangeRequest) -> Exchanged:
    """``compressing`` among a stage's copies (``places``: the gradients' places among the whole
    model's, which seed their random draws; ``root``: the stage's first copy)."""
    exchange = make_compressing(r.comm, r.seed, r.rank, r.size, list(r.params),
                                optimizer_settings(r.optimizer), r.process_set, r.root, r.places)
    return exchange, with_optimizer(exchange, r.optimizer)


def stage_sharded(r: ExchangeRequest) -> Exchanged:
    """``sharded`` among a stage's copies, in their process set. ``shard.stage=1``: the
    stage's allreduce becomes a reduce-scatter, the shard's update and an all-gather
    (:mod:`hvdtrain.torch.shard`). Stages 2-3 (``r.model``: the rank's layers,
    :func:`layers_of`): the units' hooks of :mod:`hvdtrain.torch.shard_units` run inside the
    schedule's passes, so each micro-batch's backward pass reduce-scatters each unit's gradient
    into the copy's shard (summed over the micro-batches: no whole gradient outlives a unit's
    pass), and at stage 3 each unit is gathered before each micro-batch's forward and backward
    pass and freed after them."""
    assert r.shard is not None and r.model is not None, "a stage's sharded update needs both"
    if r.shard.stage >= 2:
        # root=None: every copy built the stage's layers from the same seed, and the engine's
        # fresh start broadcasts copy 0's shards in the stage's set.
        return make_unit_sharded(r.optimizer, r.model, r.rank, r.size, r.shard,
                                 r.comm.compression, r.accumulation, r.process_set, root=None)
    return make_sharded(r.optimizer, r.model, r.rank, r.size, chunk_elements(r.shard.chunk_kib),
                        r.comm.compression, r.process_set)
