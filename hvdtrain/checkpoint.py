"""Checkpoint policy and atomic file I/O (framework-free; the engine serialises its own state).

A checkpoint is written to a temporary file in the same directory, flushed and fsynced, then renamed
over its final name, so a crash leaves either the old set of checkpoints or the new one, never a
half-written file under a checkpoint's name. A manifest ``step-N.json`` written after it holds the
file's sha256: a checkpoint counts only when its manifest exists and the hash matches, so a file
truncated or corrupted later (a full disk, a bad copy) is detected and skipped on resume.

A write that fails (a full disk) removes what it had written and stops the run on every rank, at
the loop's next log interval or next checkpoint, whichever comes first (or at its end), with an
:class:`~hvdtrain.errors.EnvironmentFailure` naming the file; the checkpoints written before stay
valid. Rank 0's other writes that a resume relies on (``metrics.jsonl``) hand their failures to
:meth:`CheckpointManager.hold_failure`, to be shared the same way.

An engine with pipeline stages (:class:`~hvdtrain.engine.PartedState`) writes a checkpoint in
parts that do not depend on the split: each stage's first copy writes its own layers to
``step-N.stage-S.part`` (atomically, as above), an allgather over all ranks is the barrier that
carries each part's name, layers, size and sha256 (or the first failure, so that every rank
raises it at once), then rank 0 writes ``step-N.ckpt`` (no model in it) and, last, the manifest
that lists the parts: the manifest is the commit. Verifying checks every part; pruning removes
them with their checkpoint, and parts that never got a manifest. An engine of sharded data
parallel (:meth:`~hvdtrain.engine.StateIO.shard_part`) writes the same way, every rank its own
shards to ``step-N.rank-R.part`` in parallel (:mod:`hvdtrain.shard_files`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from hvdtrain.config import CheckpointConfig
from hvdtrain.engine import Collectives, Engine, PartedState
from hvdtrain.errors import RESUME_ADVICE, EnvironmentFailure, HvdtrainError, os_failure

SUFFIX = ".ckpt"
PART_SUFFIX = ".part"
POSITION_KEYS = ("step", "epoch", "in_epoch", "samples")
"""The training position every checkpoint's metadata holds (``meta["position"]``)."""


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Writes ``path`` through ``write(fileobj)`` so that it appears complete or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fileobj:
            write(fileobj)
            fileobj.flush()
            os.fsync(fileobj.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # makes the rename itself durable
    finally:
        os.close(dir_fd)


class _HashingWriter:
    """A write-only file that hashes and counts what passes through it. Writers that need to seek
    (and so could rewrite bytes already hashed) fail loudly: it has no ``seek``."""

    def __init__(self, fileobj: IO[bytes]) -> None:
        self.fileobj, self.digest, self.size = fileobj, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.size += len(view)
        return self.fileobj.write(view)

    def flush(self) -> None:
        self.fileobj.flush()


class CheckpointManager:
    """Decides when to checkpoint, writes on rank 0 (and each stage's first copy writes its part,
    :class:`~hvdtrain.engine.PartedState`), and keeps the newest ``keep`` checkpoints."""

    def __init__(self, cfg: CheckpointConfig, directory: Path) -> None:
        self.cfg = cfg
        self.directory = directory
        self._pending: threading.Thread | None = None
        self._failure: BaseException | None = None  # of the write in flight; set by its thread
        self._held: BaseException | None = None  # of rank 0's other writes (hold_failure)
        self.begun = 0  # saves begun, counted alike on every rank (each calls save)

    def due(self, step: int) -> bool:
        """Whether the periodic policy asks for a checkpoint after optimizer step ``step``."""
        every = self.cfg.every_steps
        return self.cfg.enabled and every > 0 and step % every == 0

    def save(self, engine: Engine, rank: int, step: int, meta: dict[str, Any],
             holds: bool = True) -> Path | None:
        """Called on every rank; rank 0 writes ``step-<step>.ckpt`` (after every rank's part, for
        an engine that writes in parts). Returns the path written (on rank 0; None elsewhere).

        Every rank first learns whether rank 0's previous write failed (:meth:`share_failure`),
        and then all raise its error together, rather than rank 0 alone. ``holds=False``: the
        caller never calls :meth:`hold_failure`, so before the first save there is nothing to
        share and its collective is left out (the own-loop APIs' single final save).
        """
        if not self.cfg.enabled:
            return None
        if holds or self.begun:
            self.share_failure(engine.collectives, rank)
        self.begun += 1
        parts = None
        if isinstance(engine, PartedState):
            # A collective: every rank's part is on disk when it returns.
            staged = engine.part_bytes()
            parts = self._save_part(engine.collectives, None if staged is None else (
                staged[0], {"layers": list(staged[1])}, _writes(staged[2])), step)
        elif (shard := _shard_part(engine)) is not None:  # every rank its shards, in parallel
            parts = self._save_part(engine.collectives, shard, step)
        else:
            engine.gather_state()  # a collective: every rank, before rank 0 writes
        if parts is not None:
            meta = {**meta, "parts": parts}
        if rank != 0:
            return None
        # The state is serialised now; the disk work (write, fsync, rename, manifest) runs in a
        # thread while training goes on, so a step pays for serialising only. A write killed half
        # way has no manifest and never counts; the run waits for the last one before it ends.
        data = engine.state_bytes({**meta, "step": step})
        self._pending = threading.Thread(target=self._write_behind, args=(step, data, parts),
                                         name=f"hvdtrain-checkpoint-{step}")
        self._pending.start()
        return self.path_for(step)

    def _save_part(self, collectives: Collectives,
                   part: tuple[str, dict[str, Any], Callable[[IO[bytes]], object]] | None,
                   step: int) -> list[dict[str, Any]]:
        """Writes this rank's ``part`` (label, the fields its manifest entry adds, a function
        that writes it; None if it has none) and returns every part's manifest entry, in rank
        order; raises on every rank when any rank's write failed."""
        entry: dict[str, Any] | None = None
        if part is not None:
            label, fields, write = part
            path = self.part_path(step, label)
            try:
                entry = {**_write_hashed(path, write), **fields}
            except OSError as exc:
                entry = {"error": str(os_failure(exc, "cannot write checkpoint part", path,
                                                 self._advice(step)))}
            except Exception as exc:  # noqa: BLE001  (shared below: no rank may wait alone)
                entry = {"error": f"cannot write checkpoint part {path}: {exc!r}"}
        # Also the barrier before the manifest. In a list: Horovod names the collective after the
        # object's type, which differs between ranks with a part and ranks without.
        entries = [got[0] for got in collectives.allgather_object([entry])]
        failures = [e["error"] for e in entries if e is not None and "error" in e]
        if failures:
            if entry is not None and "error" not in entry:
                (self.directory / entry["file"]).unlink(missing_ok=True)
            raise EnvironmentFailure(failures[0])
        return [e for e in entries if e is not None]

    def failed(self) -> bool:
        """Whether rank 0's write in flight has already failed (without waiting for it), or a
        failure is held (:meth:`hold_failure`). The loop sums it over ranks with its metrics, so
        that every rank then calls :meth:`share_failure` at the same step."""
        return self._failure is not None or self._held is not None

    def hold_failure(self, failure: BaseException) -> None:
        """Keeps the failure of another write of rank 0 (``metrics.jsonl``, the dashboards), to be
        raised on every rank by the next :meth:`share_failure`, as a checkpoint's failure is; the
        first one held wins."""
        if self._held is None:
            self._held = failure

    def share_failure(self, collectives: Collectives, rank: int) -> None:
        """Called by every rank at the same point: rank 0 waits for its write in flight (one at a
        time, in step order) and tells every rank whether it, or else a write whose failure it
        holds, failed; then every rank raises that failure."""
        failure: BaseException | None = None
        if rank == 0:
            try:
                self.wait()
            except BaseException as exc:  # noqa: BLE001  (raised below on every rank at once)
                failure = exc
            failure, self._held = failure or self._held, None
        # One small allreduce says whether rank 0 failed (only rank 0 adds to it); the error itself
        # is pickled and broadcast only then, which costs two more collectives.
        if not collectives.allreduce_sums({"write_failed": float(failure is not None)})["write_failed"]:
            return
        shared = failure if isinstance(failure, HvdtrainError) else \
            HvdtrainError(f"rank 0 failed to write: {failure!r}")
        # In a list: Horovod names the broadcast after the object's type, which must be the same
        # on every rank (rank 0's error may be a subclass of the others' placeholder).
        shared = collectives.broadcast_object([shared])[0]
        raise failure if failure is not None else shared

    def _write_behind(self, step: int, data: bytes, parts: list[dict[str, Any]] | None) -> None:
        try:
            self.write(step, lambda f: f.write(data), parts)
        except OSError as exc:
            self._failure = os_failure(exc, "cannot write checkpoint", self.path_for(step),
                                       self._advice(step))
        except BaseException as exc:  # noqa: BLE001  (handed to the training thread by wait())
            self._failure = exc

    def _advice(self, step: int) -> str:
        """What to do after checkpoint ``step`` failed: where the run can continue from."""
        kept = [p for p in self.checkpoints() if p != self.path_for(step) and verify(p) is None]
        last = f"the last valid checkpoint is {kept[-1].name}" if kept else "no valid checkpoint is left"
        return f"{last}; {RESUME_ADVICE}"

    def wait(self) -> None:
        """Waits until the checkpoint being written is on disk; raises the error if it failed."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def write(self, step: int, write: Callable[[IO[bytes]], object],
              parts: list[dict[str, Any]] | None = None) -> Path:
        """Writes the checkpoint of ``step`` through ``write(fileobj)``, then its manifest (which
        lists ``parts``, already on disk, when it has some), then prunes old ones. The sha256 is
        computed from the bytes as they are written, so the file is not read back."""
        path = self.path_for(step)
        try:
            manifest: dict[str, Any] = {**_write_hashed(path, write), "step": step}
            if parts is not None:
                manifest["parts"] = parts
            text = json.dumps(manifest, indent=2) + "\n"
            atomic_write(manifest_path(path), lambda f: f.write(text.encode()))
        except BaseException:
            path.unlink(missing_ok=True)  # never counts without its manifest: free its space
            for part in parts or ():
                (self.directory / part["file"]).unlink(missing_ok=True)
            raise
        self._prune(step)
        return path

    def path_for(self, step: int) -> Path:
        """The file name of the checkpoint after optimizer step ``step``."""
        return self.directory / f"step-{step:08d}{SUFFIX}"

    def part_path(self, step: int, label: str) -> Path:
        """The file name of part ``label`` (``"stage-1"``) of the checkpoint of ``step``."""
        return self.directory / f"step-{step:08d}.{label}{PART_SUFFIX}"

    def checkpoints(self) -> list[Path]:
        """Checkpoint files present, oldest first (valid or not)."""
        return sorted(self.directory.glob(f"step-*{SUFFIX}"))

    def latest_valid(self) -> Path | None:
        """The newest checkpoint that passes :func:`verify`, warning about each newer one that fails."""
        for path in reversed(self.checkpoints()):
            problem = verify(path)
            if problem is None:
                return path
            warnings.warn(f"skipping checkpoint {path}: {problem}", stacklevel=2)
        return None

    def _prune(self, step: int) -> None:
        """Removes all but the newest ``keep`` checkpoints with their manifests and parts, after
        the checkpoint of ``step`` was committed."""
        for old in self.checkpoints()[:-self.cfg.keep]:
            for part in parts_of(old):
                part.unlink(missing_ok=True)
            old.unlink(missing_ok=True)
            manifest_path(old).unlink(missing_ok=True)
        # Parts that no kept manifest lists (a save that failed or was killed before its manifest)
        # and temporary files of a writer killed mid-save: never valid, only taking up space. No
        # rank writes now: every rank's next save first waits for this one (share_failure).
        listed = {p for ckpt in self.checkpoints() for p in parts_of(ckpt)}
        for orphan in self.directory.glob(f"step-*{PART_SUFFIX}"):
            if orphan not in listed and _step_of(orphan) <= step:
                orphan.unlink(missing_ok=True)
        for stale in self.directory.glob(".step-*.tmp"):
            stale.unlink(missing_ok=True)


def _shard_part(engine: Engine) -> tuple[str, dict[str, Any], Callable[[IO[bytes]], object]] | None:
    """The engine's :meth:`~hvdtrain.engine.StateIO.shard_part`; None for an object that stands
    for an engine without one (it writes whole, as every engine did before)."""
    shard_part = getattr(engine, "shard_part", None)
    return shard_part() if shard_part is not None else None


def _writes(data: bytes) -> Callable[[IO[bytes]], object]:
    """A writer of ``data``, as :func:`atomic_write` takes it."""
    return lambda fileobj: fileobj.write(data)


def _write_hashed(path: Path, write: Callable[[IO[bytes]], object]) -> dict[str, Any]:
    """Writes ``path`` atomically through ``write(fileobj)``; returns its manifest entry (``file``,
    ``sha256``, ``bytes``), hashed as the bytes pass, so that the file is not read back."""
    written: list[_HashingWriter] = []

    def through_hash(fileobj: IO[bytes]) -> None:
        written.append(_HashingWriter(fileobj))
        write(written[0])  # type: ignore[arg-type]

    atomic_write(path, through_hash)
    return {"file": path.name, "sha256": written[0].digest.hexdigest(), "bytes": written[0].size}


def _step_of(path: Path) -> int:
    """The step in a checkpoint file's or part's name (``step-00000012.stage-1.part``: 12)."""
    try:
        return int(path.name.split(".", 1)[0].removeprefix("step-"))
    except ValueError:
        return -1


def part_problem(entry: Any) -> str | None:
    """Why a manifest's part entry names no file of the checkpoint's directory, or None: its
    ``file`` must be a bare file name, as hvdtrain writes it (``step-N.stage-S.part``). A path
    (``../x``, ``/x``, ``sub/x``) is refused rather than cut to its last component, so that what
    is verified and what is read are one file (:func:`part_file`)."""
    name = entry.get("file") if isinstance(entry, Mapping) else None
    if not isinstance(name, str):
        return "a part entry names no file"
    separators = [sep for sep in (os.sep, os.altsep, "/") if sep]
    if name in ("", ".", "..") or "\0" in name or any(sep in name for sep in separators):
        return f"part {name!r} is not a file name in the checkpoint's directory: refused"
    return None


def part_file(directory: Path, entry: Any, where: str) -> Path:
    """The file that a manifest's part ``entry`` names in ``directory`` (the checkpoint's), as
    :func:`verify` checks it and both frameworks' readers read it; a one-line
    :class:`HvdtrainError` naming ``where`` for an entry that names a path (:func:`part_problem`)."""
    problem = part_problem(entry)
    if problem:
        raise HvdtrainError(f"{where}: {problem}")
    return directory / entry["file"]


def parts_of(checkpoint: Path) -> list[Path]:
    """The part files that the manifest of ``checkpoint`` lists (none for a checkpoint written
    whole, or whose manifest cannot be read; an entry that names a path is left out: pruning
    never removes a file outside the directory)."""
    try:
        manifest = json.loads(manifest_path(checkpoint).read_text())
        entries = manifest.get("parts") or ()
        return [checkpoint.parent / p["file"] for p in entries if part_problem(p) is None]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return []


def manifest_path(checkpoint: Path) -> Path:
    """Where the manifest of a checkpoint file lives."""
    return checkpoint.with_suffix(".json")


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as fileobj:
        for block in iter(lambda: fileobj.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(path: Path) -> str | None:
    """Why a checkpoint cannot be trusted (no manifest, size or sha256 mismatch), or None if it can."""
    try:
        manifest = json.loads(manifest_path(path).read_text())
    except (OSError, ValueError):
        return "no readable manifest (the write did not finish)"
    if not isinstance(manifest, dict):
        return "the manifest is not an hvdtrain manifest"
    problem = _file_problem(path, manifest)
    if problem:
        return problem
    parts = manifest.get("parts") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("file"), str)
                                              for p in parts):
        return "the manifest's list of parts is not an hvdtrain one"
    for part in parts:
        problem = part_problem(part)
        if problem:
            return problem
        problem = _file_problem(part_file(path.parent, part, str(path)), part)
        if problem:
            return f"part {part['file']}: {problem}"
    return None


def _file_problem(path: Path, entry: dict[str, Any]) -> str | None:
    """Why one file does not match its manifest entry (``bytes``, ``sha256``), or None."""
    try:
        if not path.exists() or path.stat().st_size != entry.get("bytes"):
            return "size differs from the manifest (truncated?)"
        if sha256_of(path) != entry.get("sha256"):
            return "sha256 differs from the manifest (corrupted)"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    return None


def checked_position(meta: Any, where: str) -> dict[str, int]:
    """The training position in a checkpoint's metadata, or a one-line error naming ``where``
    when the file holds none (it was not written by hvdtrain)."""
    position = meta.get("position") if isinstance(meta, dict) else None
    if not isinstance(position, dict) or not all(
            isinstance(position.get(k), int) and not isinstance(position.get(k), bool)
            for k in POSITION_KEYS):
        raise HvdtrainError(f"{where} is not an hvdtrain checkpoint: its metadata holds no "
                            "training position")
    return {k: position[k] for k in POSITION_KEYS}


def not_a_checkpoint(where: str, reason: BaseException | str) -> HvdtrainError:
    """The one-line error for a file that an engine's reader refused: not a checkpoint written by
    hvdtrain, or cut short. ``reason``: the reader's exception (its first line is shown) or words."""
    if isinstance(reason, BaseException):
        first = (str(reason).strip().splitlines() or [""])[0]
        reason = f"{type(reason).__name__}: {first[:100]}" if first else type(reason).__name__
    return HvdtrainError(f"{where} is not an hvdtrain checkpoint or is damaged ({reason}); "
                         "point checkpoint.resume at a step-*.ckpt file that hvdtrain wrote")
