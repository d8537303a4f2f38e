"""``hvdtrain export RUN_DIR --format safetensors|hf|keras|weights.h5`` (docs/huggingface.md): a
run's newest valid checkpoint written for other tools, framework-free here.

``safetensors`` writes ``model.safetensors``, the model's weights under the names the checkpoint
holds them (a tensor shared by two names, as a tied embedding and head, is written once under its
first name; the others are listed in the file's metadata as ``aliases``). ``hf`` writes a
directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads, for runs of
``model.name: hf_causal_lm``, with the corpus's tokenizer beside it where the corpus has one.
For TensorFlow runs, ``keras`` writes the whole Keras model (``model.keras``) and ``weights.h5`` its
weights (``model.weights.h5``). Every format but ``hf`` copies the corpus's tokenizer file beside
the weights where the run's data has one. The frameworks' halves are ``hvdtrain/torch/export.py`` and
``hvdtrain/tensorflow/export.py``.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from hvdtrain.checkpoint import CheckpointManager
from hvdtrain.config import Config, load_config
from hvdtrain.errors import HvdtrainError
from hvdtrain.rundir import RunDir

FORMATS_OF = {"torch": ("safetensors", "hf"), "tensorflow": ("keras", "weights.h5")}
"""The formats each framework's runs export to."""
FORMATS = tuple(fmt for formats in FORMATS_OF.values() for fmt in formats)


@dataclass(frozen=True)
class ExportRequest:
    """What to export: the run, its config and checkpoint, the format and the output directory."""

    run: RunDir
    config: Config
    checkpoint: Path
    format: str
    out: Path


def request(run_dir: str, fmt: str, out: str | None = None) -> ExportRequest:
    """Checks the run directory and finds its newest valid checkpoint; one line for a directory
    that is no run, a run without a checkpoint, or a format the run's model cannot take."""
    if fmt not in FORMATS:
        raise HvdtrainError(f"export --format={fmt!r}: expected one of {', '.join(FORMATS)}")
    run = RunDir(run_dir)
    if not run.config.is_file():
        raise HvdtrainError(f"export: {run_dir} is not a run directory (no config.yaml)")
    cfg = load_config(run.config, environ={})
    checkpoint = CheckpointManager(cfg.checkpoint, run.checkpoints).latest_valid()
    if checkpoint is None:
        raise HvdtrainError(f"export: {run_dir} has no valid checkpoint in {run.checkpoints} "
                            "(set checkpoint.every_steps; a run checkpoints at its end)")
    if fmt not in FORMATS_OF.get(cfg.framework, ()):
        raise HvdtrainError(f"export --format={fmt}: runs of framework={cfg.framework} export "
                            f"to {', '.join(FORMATS_OF.get(cfg.framework, ()))}")
    if fmt == "hf" and cfg.model.name != "hf_causal_lm":
        raise HvdtrainError(f"export --format=hf: the run's model is {cfg.model.name!r}; only "
                            "model.name=hf_causal_lm exports as a transformers directory (use "
                            "--format=safetensors)")
    return ExportRequest(run, cfg, checkpoint, fmt,
                         Path(out) if out else run.root / f"export-{fmt}")


def export(run_dir: str, fmt: str, out: str | None = None) -> Path:
    """Exports the run's newest valid checkpoint; returns the directory written."""
    req = request(run_dir, fmt, out)
    if req.config.framework == "tensorflow":
        from hvdtrain.tensorflow.export import export_tensorflow

        export_tensorflow(req.config, req.checkpoint, req.format, req.out)
    else:
        from hvdtrain.torch.export import export_torch

        export_torch(req.config, req.checkpoint, req.format, req.out)
    if req.format != "hf":  # hf writes it as a transformers tokenizer
        copy_tokenizer(req.config, req.out)
    return req.out


def copy_tokenizer(cfg: Config, out: Path) -> None:
    """Copies the tokenizer file of the run's corpus (``data.name`` text or hf_dataset, made by
    ``make-text --tokenizer``) into ``out``, beside the weights; nothing for other data."""
    if cfg.data.name not in ("text", "hf_dataset"):
        return  # no need to open the data
    from hvdtrain.driver import make_dataset

    tokenizer = getattr(make_dataset(cfg), "tokenizer", None)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / Path(tokenizer).name)
