"""The run directory: every path in it, and the rules for creating, reusing and trimming it.

A run directory holds everything a run produced. Only rank 0 writes to it; every other module asks
:class:`RunDir` for a path instead of spelling a file name.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hvdtrain.checkpoint import atomic_write
from hvdtrain.config import Config, save_config
from hvdtrain.errors import HvdtrainError, os_failure


class RunDir:
    """The files of one run under ``root`` (``Config.run_dir``: log.dir, else runs/<name>)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def config(self) -> Path:
        """The resolved config the run was started with."""
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        """One JSON record per logged step (:mod:`hvdtrain.observe.sinks`)."""
        return self.root / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        """The run's summary, written at its end."""
        return self.root / "summary.json"

    @property
    def checkpoints(self) -> Path:
        """Checkpoints and their manifests (:mod:`hvdtrain.checkpoint`)."""
        return self.root / "checkpoints"

    @property
    def events(self) -> Path:
        """Elastic events (start, reset), one JSON object per line."""
        return self.root / "elastic.jsonl"

    @property
    def elastic_commits(self) -> Path:
        """Elastic mode's commits of a sharded run: every rank's shards
        (:class:`~hvdtrain.elastic.CommitParts`)."""
        return self.root / "elastic-commits"

    @property
    def indices(self) -> Path:
        """Elastic mode's record of the sample indices trained on, one file per epoch."""
        return self.root / "indices"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard's event files."""
        return self.root / "tensorboard"

    @property
    def wandb_id(self) -> Path:
        """The W&B run id, kept so that a resumed run continues the same W&B run."""
        return self.root / "wandb_id"

    @property
    def report(self) -> Path:
        """``hvdtrain report``'s default output: its plots and ``report.md``."""
        return self.root / "report"

    @property
    def stall_report(self) -> Path:
        """The stall watchdog's verdict over all ranks."""
        return self.root / "stall.txt"

    def stall_note(self, rank: int) -> Path:
        """What the stall watchdog of ``rank`` saw."""
        return self.root / f"stall-rank{rank}.json"

    def stacks(self, rank: int) -> Path:
        """The Python stacks of ``rank`` at a stall."""
        return self.root / f"stacks-rank{rank}.txt"

    @property
    def job_script(self) -> Path:
        """The rendered sbatch script of a submitted job."""
        return self.root / "job.sbatch"

    def slurm_output(self, job_id: str = "%j") -> Path:
        """Slurm's output file of job ``job_id`` (``%j``: sbatch's pattern for it)."""
        return self.root / f"slurm-{job_id}.out"

    @property
    def stop_flag(self) -> Path:
        """Left by a Slurm job's rank that exited 75 (stopped to be resubmitted)."""
        return self.root / ".slurm-exit-75"

    @property
    def exclude_hosts(self) -> Path:
        """Host names, one per line, that an elastic Slurm job's host discovery leaves out."""
        return self.root / "exclude-hosts"

    def check_unused(self, overwrite: bool) -> None:
        """Refuses to mix two runs in one directory unless asked to overwrite."""
        existing = [p.name for p in (self.metrics, self.summary, self.config) if p.exists()]
        if existing and not overwrite:
            raise HvdtrainError(f"run directory {str(self.root)!r} already holds a run "
                                f"({existing[0]}); set log.overwrite=true or choose another "
                                "log.dir")

    def create(self) -> None:
        """Creates the directory and checks that files can be written in it (every rank that
        writes there calls it); a directory that cannot be created or written raises a one-line
        error naming it (an :class:`~hvdtrain.errors.EnvironmentFailure` when the file system is
        at fault), so that ranks that share the file system all stop with the same message."""
        self._guarded(self._create)

    def _create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=self.root):
            pass

    def prepare(self, cfg: Config, resumed_step: int | None) -> None:
        """Creates the directory and saves the config (rank 0).

        A fresh run (``resumed_step`` None) removes an earlier run's files and checkpoints; a
        resumed one keeps them and drops only the metrics records logged after its checkpoint. A
        directory that cannot be created or written raises a one-line error naming it (an
        :class:`~hvdtrain.errors.EnvironmentFailure` when the file system is at fault), before any
        training.
        """
        self._guarded(lambda: self._prepare(cfg, resumed_step))

    def _guarded(self, work: Callable[[], None]) -> None:
        try:
            work()
        except (OSError, ValueError) as exc:  # ValueError: a path the OS cannot take (a NUL byte)
            raise os_failure(exc, "log.dir: cannot write the run directory", self.root,
                             "choose a writable log.dir, or fix its permissions or free space",
                             "log.dir must name a directory (or where one can be made)") from None

    def _prepare(self, cfg: Config, resumed_step: int | None) -> None:
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        # Checkpoints are written by a thread during training: find out now that they can be.
        with tempfile.TemporaryFile(dir=self.checkpoints):
            pass
        if resumed_step is None:
            for path in (self.metrics, self.summary, self.config, self.events):
                path.unlink(missing_ok=True)
            for old in self.checkpoints.glob("step-*"):  # checkpoints and their manifests
                old.unlink()
        else:
            self.trim_metrics(resumed_step)
        save_config(cfg, self.config)

    def trim_metrics(self, step: int) -> None:
        """Drops records logged after ``step`` (between a checkpoint or commit and a failure), which
        the run logs again, so that ``metrics.jsonl`` holds each step once.

        Records are appended in step order, so those kept are the file's first lines: the file is
        cut back in place. That needs no free space, and it keeps the file that rank 0's sink has
        open for appending across an elastic reset (a new file put in its place would not be it).
        """
        if not self.metrics.exists():
            return
        text = self.metrics.read_text(errors="replace")
        kept = itertools.takewhile(lambda record: record.get("step", 0) <= step,
                                   parse_records(text, self.metrics))
        lines = text.splitlines(keepends=True)
        # kept is a prefix of lines: zip stops at its end.
        kept_lines = zip(lines, kept, strict=False)
        os.truncate(self.metrics, sum(len(line.encode()) for line, _ in kept_lines))

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Writes ``summary.json`` atomically."""
        text = json.dumps(summary, indent=2, sort_keys=True) + "\n"
        atomic_write(self.summary, lambda f: f.write(text.encode()))

    def log_event(self, event: dict[str, Any]) -> None:
        """Appends one elastic event, with the time, to :attr:`events`."""
        with self.events.open("a") as fileobj:
            fileobj.write(json.dumps({"time": time.time(), **event}) + "\n")


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file that hvdtrain appends to (``metrics.jsonl``).

    A last line that lacks its newline and does not parse is a write cut short (a full disk, rank
    0 killed mid-write): it is left out. Any other line that is not a JSON object is a damaged
    file: a one-line :class:`~hvdtrain.errors.HvdtrainError` naming the file and line.
    """
    return parse_records(path.read_text(errors="replace"), path)


def parse_records(text: str, path: Path) -> list[dict[str, Any]]:
    """:func:`read_records` of a file's ``text`` already read (``path`` names it in errors)."""
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines) and not text.endswith("\n"):
                break
            record = None
        if not isinstance(record, dict):
            raise HvdtrainError(f"{path}:{number}: not a JSON object; the file is damaged (move it "
                                "away to start afresh, or repair the line)")
        records.append(record)
    return records
