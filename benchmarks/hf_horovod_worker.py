"""The runs of ``hf_horovod.py``: a Hugging Face GPT-2 trained by hvdtrain (``model.name:
hf_causal_lm``) and by a plain Horovod loop, on the same data, weights, optimizer and schedule.

Both load the same initial weights (a ``save_pretrained`` directory the driver wrote once, with
:func:`make_model`) and train the same token windows in the same order: the plain loop reads them
from hvdtrain's own ``TextDataset`` and ``ShardedSampler`` (epoch 0, seed :data:`SEED`), which is
what hvdtrain's loop trains on, so only the training machinery differs. Everything else in the
plain loop is what a user writes after Horovod's PyTorch examples: ``hvd.DistributedOptimizer``
around Adam at ``LR x size``, the broadcasts, the mean token cross-entropy, the warm-up and cosine
schedule of ``configs/hf_torch.yaml`` written out by hand.

Each run clocks the start of every optimizer step (hvdtrain's through a ``Callback``); the steady
state is from the start of step :func:`skip_steps` to the start of the last step, the same span on
both sides (no evaluation, checkpoint or start-up inside it). The plain loop keeps its per-step
loss locally and averages the list over the ranks once after training, so its step has no extra
collective; hvdtrain's per-step losses come from its ``metrics.jsonl`` in the variant that logs
every step (``hvdtrain_losses``), while the timed variant (``hvdtrain``) logs every
:data:`LOG_EVERY` steps, the config's default.

Settings come from the environment the driver sets (``HF_BENCH_DIR``: the directory holding
``corpus/`` and ``model/``); ``workload.job_main`` hands its ``--epochs`` to each run as the number
of optimizer steps it trains.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's hvdtrain, installed or not

import workload  # noqa: E402

BATCH_SIZE = 8
"""Token windows per rank per step."""
SEQ_LEN = 128
LR = 3e-4
"""One rank's learning rate (scaled by the world size, ``optim.scale_lr``)."""
WARMUP = 5
SEED = 0
LOG_EVERY = 10
MODEL = {"n_layer": 4, "n_embd": 128, "n_head": 4, "n_positions": SEQ_LEN, "resid_pdrop": 0.0,
         "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": None, "eos_token_id": None}
"""The GPT-2 config (without dropout: a random mask would differ between the two loops)."""


def bench_dir() -> Path:
    return Path(os.environ["HF_BENCH_DIR"])


def skip_steps(steps: int) -> int:
    """Steps left out of the steady state at the start of a run: a fifth, at least one."""
    return max(1, steps // 5)


def lr_at(step: int, steps: int, size: int) -> float:
    """The plain loop's learning rate at 0-based ``step`` of ``steps``: linear warm-up from LR to
    LR x size over WARMUP steps, then a cosine to 0 over the rest (``configs/hf_torch.yaml``'s
    schedule, written as a user would)."""
    peak = LR * size
    if step < WARMUP:
        return LR + (peak - LR) * (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / max(1, steps - WARMUP))
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def record(rank: int, steps: int, size: int, starts: list[float], wall: float,
           losses: list[float] | None) -> dict[str, Any]:
    """One run's record: steady-state samples/s and step time, the whole run's wall time, and the
    per-step losses averaged over the ranks (None where not logged every step)."""
    skip = skip_steps(steps)
    span, counted = starts[-1] - starts[skip], len(starts) - 1 - skip
    return {"rank": rank, "steps": steps, "wall_time_s": wall,
            "steady_step_time_s": span / counted,
            "steady_samples_per_s": counted * BATCH_SIZE * size / span, "losses": losses}


def run_plain(steps: int, out_dir: Path) -> dict[str, Any]:
    """The plain Horovod loop; every call starts from the saved weights, as hvdtrain's run does."""
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F
    import transformers

    from hvdtrain.data.sampler import ShardedSampler
    from hvdtrain.data.text import TextDataset

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(workload.threads_per_rank(hvd.local_size()))
    torch.manual_seed(SEED + rank)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        bench_dir() / "model", local_files_only=True, dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    source = TextDataset(str(bench_dir() / "corpus"), seq_len=SEQ_LEN).train()
    plan = ShardedSampler(len(source), BATCH_SIZE, seed=SEED).steps(0, rank, size)
    if len(plan) < steps:
        raise SystemExit(f"the corpus has {len(plan)} steps in an epoch, fewer than {steps}")
    starts, losses = [], []
    started = time.perf_counter()
    for number, step in enumerate(plan.steps[:steps]):
        starts.append(time.perf_counter())
        for group in optimizer.param_groups:
            group["lr"] = lr_at(number, steps, size)
        batch = source.load(step.micro[0])
        x, y = torch.from_numpy(batch.x), torch.from_numpy(batch.y)
        optimizer.zero_grad()
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    wall = time.perf_counter() - started
    mean = hvd.allreduce(torch.tensor(losses, dtype=torch.float64), op=hvd.Average, name="losses")
    return record(rank, steps, size, starts, wall, mean.tolist())


def run_hvdtrain(steps: int, out_dir: Path, every_step: bool = False) -> dict[str, Any]:
    """``hvdtrain train configs/hf_torch.yaml`` with the plain loop's settings, in process."""
    from hvdtrain.config import load_config
    from hvdtrain.driver import train
    from hvdtrain.loop import Callback

    class Starts(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_step_start(self, step: int) -> None:
            self.starts.append(time.perf_counter())

    clock = Starts()
    cfg = load_config(ROOT / "configs" / "hf_torch.yaml",
                      overrides(steps, out_dir, 1 if every_step else LOG_EVERY), environ={})
    result = train(cfg, callbacks=[clock])
    rank, size = result.engine.rank, result.engine.size
    losses = None
    if every_step and rank == 0:
        lines = (out_dir / "metrics.jsonl").read_text().splitlines()
        logged = [json.loads(line) for line in lines if line.strip()]
        losses = [r["loss"] for r in logged if "loss" in r and "step" in r]
    return record(rank, steps, size, clock.starts, result.summary["wall_time_s"], losses)


def overrides(steps: int, out_dir: Path, log_every: int) -> list[str]:
    """What the run sets beside ``configs/hf_torch.yaml``: the plain loop's settings."""
    return [
        "framework=torch", "model.name=hf_causal_lm",
        f"model.options.pretrained={bench_dir() / 'model'}", "data.name=text",
        f"data.options.root={bench_dir() / 'corpus'}", f"data.options.seq_len={SEQ_LEN}",
        f"data.batch_size={BATCH_SIZE}", "data.shuffle=true", f"seed={SEED}", "train.epochs=1",
        f"train.max_steps={steps}", "train.threads=0", "train.backward_passes_per_step=1",
        "train.precision=fp32", "optim.name=adam", f"optim.lr={LR}", "optim.scale_lr=true",
        "optim.weight_decay=0", f"optim.warmup_steps={WARMUP}", "optim.schedule=cosine",
        "optim.clip_norm=0", "comm.compression=none", "checkpoint.enabled=false",
        "checkpoint.every_steps=0",
        "log.overwrite=true", f"log.dir={out_dir}", f"log.every_steps={log_every}",
        *workload.SINKS["default"],
    ]


def make_model(out: Path, vocab_size: int) -> None:
    """Writes the initial GPT-2 (seeded) with ``save_pretrained``: both loops load it."""
    import torch
    import transformers

    torch.manual_seed(SEED)
    config = transformers.GPT2Config(vocab_size=vocab_size, **MODEL)
    transformers.GPT2LMHeadModel(config).save_pretrained(out)


VARIANTS = {"plain": run_plain, "hvdtrain": run_hvdtrain,
            "hvdtrain_losses": functools.partial(run_hvdtrain, every_step=True)}
"""This worker's run functions by ``harness.Variant`` key."""


if __name__ == "__main__":  # the driver writes the model in a process of its own
    make_model(Path(sys.argv[1]), int(sys.argv[2]))
