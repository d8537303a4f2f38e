"""The checkpoint side of a TensorFlow pipeline stage: its part, and its share on resume.

Each stage's first copy writes its layers' variables and its optimizer's by global name
(:mod:`hvdtrain.tensorflow.parts`), with its exchange's state (every copy's residuals, gathered in
the stage's process set first) by variable name; on resume copy 0's ranks read the parts that hold
their layers under this run's split, or their entries of a checkpoint written without stages, and
the stage's Horovod broadcasts (``PipelineEngine.broadcast_state``) hand them to the other copies,
each copy its own row of residuals.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain.checkpoint import not_a_checkpoint
from hvdtrain.compression.state import by_index, by_name
from hvdtrain.engine import Collectives, PartedState
from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import GradientExchange
from hvdtrain.pipeline.state import parts_holding, parts_misfit
from hvdtrain.tensorflow import parts, rng
from hvdtrain.tensorflow.stages import ShardSlots, slot_entries


class StageState(PartedState):
    """The checkpoint methods of :class:`hvdtrain.tensorflow.pipeline.PipelineEngine`."""

    collectives: Collectives
    copy: int
    stage: int
    first_layer: int
    layer_count: int
    layers: list[Any]
    optimizer: Any
    exchange: GradientExchange
    trainable: list[str]
    """The global names of this stage's trainable variables, in its exchange's order."""
    all_trainable: list[str]
    """The whole model's, in the order of its exchange (a checkpoint written whole)."""
    slots: ShardSlots | None
    """A sharded stage's optimizer slots (``shard.stage`` 1-3), else None."""
    units: Any
    """A stage-3 stage's :class:`hvdtrain.tensorflow.stages.StageUnits`, else None."""
    restore_from: Path | None
    _restored: dict[str, Any] | None

    def _load_share(self, restored: dict[str, Any]) -> None:
        """This rank's share of the checkpoint rank 0 found (copy 0's ranks read it); a failure
        on any rank stops every rank (a collective)."""
        problem = None
        if self.copy == 0:
            try:
                entries, where = self._own_entries(), restored["where"]
                path = Path(restored["path"])
                if restored["parts"]:
                    layers = range(self.first_layer, self.first_layer + len(self.layers))
                    values, named = parts.read_parts(
                        path.parent, parts_holding(restored["parts"], layers), entries, where)
                else:
                    values = parts.read_whole(path, entries, where)
                    # Written whole: its slots follow the whole model's trainable variables.
                    named = by_name(parts.read_compression(path, where), self.all_trainable)
                parts.assign(entries, values, where)
                self.exchange.load_state_dict(by_index(named, self.trainable), where)
            except HvdtrainError as exc:
                problem = str(exc)
            except Exception as exc:  # noqa: BLE001  (shared below: no rank may wait alone)
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                problem = f"{restored['where']} does not fit the model: {first[:160]}"
        # In a list: Horovod names the collective after the object's type (None or a str).
        failures = [p[0] for p in self.collectives.allgather_object([problem]) if p[0]]
        if failures:
            raise HvdtrainError(failures[0])

    def _own_entries(self) -> dict[str, Any]:
        """This stage's variables and its optimizer's, by global name (a sharded stage's slots
        as a stage without sharding holds them: :class:`hvdtrain.tensorflow.stages.ShardSlots`)."""
        return slot_entries(parts.named_state(self.layers, self.first_layer, self.optimizer),
                            self.slots)

    def part_bytes(self) -> tuple[str, list[int], bytes] | None:
        """Copy 0's ranks write their layers, with every copy's exchange state (residuals differ
        per copy: gathered first, a collective in the stage's process set); the other copies
        hold the same layers. At ``shard.stage=3`` the layers are gathered whole for the write
        (a collective in the stage's set), then released."""
        if self.units is None:
            return self._part_bytes()
        self.units.materialise()
        try:
            return self._part_bytes()
        finally:
            self.units.release()

    def _part_bytes(self) -> tuple[str, list[int], bytes] | None:
        self.exchange.gather()
        if self.slots is not None:  # every copy's shard of each slot, whole (in the stage's set)
            self.slots.gather()
        if self.copy != 0:
            if self.slots is not None:
                self.slots.whole = {}
            return None
        layers = list(range(self.first_layer, self.first_layer + len(self.layers)))
        compression = by_name(self.exchange.state_dict(), self.trainable)
        written = parts.part_bytes(self._own_entries(), compression)
        if self.slots is not None:
            self.slots.whole = {}
        return f"stage-{self.stage}", layers, written

    def state_bytes(self, meta: dict[str, Any]) -> bytes:
        """Rank 0's ``step-N.ckpt`` beside the parts: its random states and ``meta`` (which lists
        the parts), no model."""
        arrays: dict[str, Any] = {f"rng/{name}": v for name, v in rng.capture().items()}
        buffer = io.BytesIO()
        np.savez(buffer, meta=np.array(json.dumps(meta)), **arrays)
        return buffer.getvalue()

    def load_state(self, data: bytes, where: str) -> dict[str, Any]:
        """Rank 0 reads a checkpoint's random states and meta, and keeps where each rank reads
        its share (:meth:`broadcast_state`): parts of any split, or one written whole."""
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                arrays = {name: npz[name] for name in npz.files if not name.startswith(
                    ("model/", "optimizer/", "compression/"))}
            meta = json.loads(str(arrays["meta"]))
            if not isinstance(meta, dict):
                raise KeyError("meta is not a mapping")
        except Exception as exc:  # noqa: BLE001  (whatever the file holds: one line naming it)
            raise not_a_checkpoint(where, exc) from None
        entries = meta.get("parts")
        problem = parts_misfit(entries, self.layer_count) if entries else None
        if not entries and "names/model" not in arrays:
            problem = ("it lists no global names of its entries (written before hvdtrain saved "
                       "them, or not by a Sequential model): resume it without pipeline stages")
        if problem or self.restore_from is None:
            raise HvdtrainError(f"{where} does not fit the model: {problem or 'no file'}")
        self._restored = {"path": str(self.restore_from), "parts": entries, "where": where}
        states = {name[4:]: value for name, value in arrays.items() if name.startswith("rng/")}
        if states:
            rng.restore(states)
        return meta

