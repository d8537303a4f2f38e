"""Gradient compression judged at convergence, beside torch's PowerSGD hook (issue 60, point 4).

The model is the MNIST-1D paper's small 1-D CNN (``compression.py``'s ``mnist1d-cnn``: the digits
config, ``data.name=mnist1d``, 60 epochs of 63 steps, SGD momentum 0.9 at 0.05 x 2 ranks, cosine),
a budget where ``none``'s eval curve is flat for its last epochs (the script checks and prints it).
Per seed, one ``horovodrun -np 2 --gloo`` job trains every hvdtrain variant (``compression.py``'s
worker; ``<method>+dense_steps=N`` adds the dense start), then ``torchrun --nproc-per-node 2``
trains the anchor (``compression_hook.py``): plain DDP, and DDP with torch's ``powerSGD_hook``
(rank 2, error feedback, warm start) at each ``--hook-starts`` value of ``start_powerSGD_iter``.

Figures, over seeds with 95% intervals (Student's t, paired by seed against ``none``, or for the
hook against plain DDP): final eval accuracy and its loss; bytes summed over the run against dense
(hvdtrain's wire bytes); steps to ``none``'s final accuracy (first epoch-end evaluation at or
above the seed's ``none`` final accuracy less 0.5 point); and that many steps timed over a 100
Mbit/s link, a model: each step costs the run's measured step time on this host plus its wire
bytes per rank at 12.5 MB/s (a 2-rank ring or allgather sends about one copy per rank per step).

``--dataset images`` trains ResNet-18 instead (``configs/images_torch.yaml``, width 16, on
``compression.py``'s generated images, 4,000 training and 1,000 test, SGD momentum 0.9 at 0.01 x 2
ranks, cosine) for ``--steps`` steps, and the anchor on the same images, model, sampler, augmentation
draws and schedule. ``--framework tensorflow`` trains hvdtrain's runs with TensorFlow
(``configs/images_tf.yaml``, the same images and overrides; no anchor: torch's hook is PyTorch's).
``--hook-only`` runs the anchor alone (a seed's hook runs, merged with ``--merge`` beside that
seed's hvdtrain runs from another job).

``--dataset lm`` trains the built-in GPT (``configs/lm_torch.yaml`` at d_model ``--width``, 32 by
default, :data:`GPT_WIDTH`: 2 blocks, byte tokens, Adam at 0.0015 x 2 ranks with 20 warm-up
steps, cosine; ``--optimizer sgd``: SGD momentum 0.9 at 0.05) for ``--steps`` steps on a fixed
corpus generated at run time from a seed, no download (:func:`sentence_text`), evaluated every
epoch (53 steps); its figure is eval perplexity and a method's loss its relative increase over
``none``'s (percent). Its anchor runs the same GPT, corpus, sampler, Adam and schedule under
``torchrun`` (``compression_hook.py --dataset lm``), the hook's increase taken over plain DDP's
perplexity.

Usage (from the repository root)::

    nice -n 10 .venv/bin/python benchmarks/compression_convergence.py --seeds 3
    nice -n 10 .venv/bin/python benchmarks/compression_convergence.py --dataset images --steps 1000 \
        --methods topk,powersgd --dense -1 --hook-starts none --flat-epochs 5
    nice -n 5 .venv/bin/python benchmarks/compression_convergence.py --dataset lm --width 64 \
        --steps 1200 --methods topk,powersgd --dense -1 --hook-starts 120 --flat-epochs 4 --seeds 5
    nice -n 10 .venv/bin/python benchmarks/compression_convergence.py --dataset images --steps 1000 \
        --seeds 1 --seed-from 3 --hook-only --hook-starts 30 --json /tmp/hook-s3.json
    .venv/bin/python benchmarks/compression_convergence.py --quick   # a tiny end-to-end check
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import compression as comp
import harness

DATASET = "mnist1d-cnn"
LINK_BYTES_PER_S = 100e6 / 8
"""A 100 Mbit/s link."""
SLACK = 0.005
"""Steps to ``none``'s final accuracy count the first evaluation within this of it."""
FLAT_EPOCHS = 10
"""``none`` counts as converged where its last this many evaluations lie within 1 point."""
CORPUS_SEED = 60
"""The seed the GPT's generated corpus is drawn from (:func:`sentence_text`): a fixed text."""
CORPUS_BYTES = 120_000
"""The corpus's size: 108,000 training tokens, 56 steps an epoch at 2 ranks, so that ``none``'s
curve has an evaluation every 56 steps."""
WORDS = 40
"""The generated corpus's vocabulary of made-up words (300 took a d_model 32 GPT past 400 steps)."""
GPT_WIDTH = 32
"""The GPT's default ``model.options.d_model`` here (``--width``): half ``configs/lm_torch.yaml``'s
64 (2 blocks, 4 heads; 43,904 parameters), small enough for 5 seeds of each method on a loaded
2-core host. At the config's 64 (136,960 parameters) PowerSGD's matrices are 64 x 192 and larger,
so rank 2 sends about 18x fewer bytes a step, not 10x."""


def variants(methods: Sequence[str], dense: Sequence[int]) -> list[str]:
    """``none`` and every compressing method at every dense start."""
    out = ["none"]
    for m in (m for m in methods if m):
        out += [m if d < 0 else f"{m}+dense_steps={d}" for d in dense]
    return out


def curve(run_dir: Path, metric: str = "accuracy") -> list[tuple[int, float]]:
    """(step, eval ``metric``) of a run's evaluations, from its metrics file."""
    key = f"eval_{metric}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(int(r["step"]), float(r[key])) for r in rows if key in r]


def steps_to(points: Sequence[tuple[int, float]], target: float,
             lower_better: bool = False) -> int | None:
    """The first evaluation's step at or above ``target`` (``lower_better``, perplexity: at or
    below it, within :data:`SLACK` of it relatively)."""
    if lower_better:
        return next((s for s, a in points if a <= target * (1 + SLACK)), None)
    return next((s for s, a in points if a >= target - SLACK), None)


def sentence_text(seed: int = CORPUS_SEED, size: int = CORPUS_BYTES) -> str:
    """A generated text with a known structure: :data:`WORDS` made-up words of 2-7 letters, and
    sentences of 4-11 words whose next word follows the last from 4 successors (probabilities
    0.4, 0.3, 0.2, 0.1), all drawn from ``seed``. A byte-level model that learns the spellings
    and the successors reaches its floor within a few hundred steps: a budget where ``none``
    converges on this host."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, rng.integers(2, 8))) for _ in range(WORDS)]
    after = rng.integers(0, WORDS, (WORDS, 4))
    odds = np.array([0.4, 0.3, 0.2, 0.1])
    parts: list[str] = []
    length = 0
    while length < size:
        word = int(rng.integers(WORDS))
        sentence = [words[word].capitalize()]
        for _ in range(int(rng.integers(3, 11))):
            word = int(after[word, rng.choice(4, p=odds)])
            sentence.append(words[word])
        parts.append(" ".join(sentence) + ".\n")
        length += len(parts[-1])
    return "".join(parts)[:size]


def fixed_corpus(work: Path) -> Path:
    """The GPT's corpus, :func:`sentence_text` written as ``hvdtrain data make-text`` writes a
    file (byte tokens, the last tenth for evaluation); returns its root."""
    from hvdtrain.data.text import make_text

    root = work / "gpt-text"
    for name in comp.CORPUS_FILES:  # a previous run's: make_text writes only into an empty one
        (root / name).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sentences.txt"
        path.write_text(sentence_text())
        make_text([path], root)
    return root


def lm_budget(root: Path, steps: int, width: int = GPT_WIDTH) -> list[str]:
    """The GPT's overrides: the corpus, its width (``model.options.d_model``), and enough epochs
    for ``steps`` at 2 ranks, capped there by ``train.max_steps``."""
    windows = (root / "train.bin").stat().st_size // 65  # byte tokens, seq_len 64 + its target
    per_epoch = max(1, windows // (2 * 16) - 1)  # fewer rather than more: max_steps caps it
    return [*comp.lm_overrides(root, steps), f"model.options.d_model={width}",
            f"train.epochs={max(1, math.ceil(steps / per_epoch))}"]


def interval(values: Sequence[float]) -> tuple[float, float, float]:
    """Mean and its 95% interval (Student's t); the interval is the mean itself for one value."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, mean, mean
    half = comp.T975[len(values) - 1] * statistics.stdev(values) / len(values) ** 0.5
    return mean, mean - half, mean + half


def image_budget(root: Path, steps: int) -> list[str]:
    """ResNet-18's overrides: the generated images, and enough epochs for ``steps`` at 2 ranks
    (the config's 5 give 315), capped there by ``train.max_steps``."""
    per_epoch = math.ceil(comp.IMAGE_SET["train"] / (2 * 32))
    return [*comp.image_overrides(root, steps),
            f"train.epochs={max(5, math.ceil(steps / per_epoch))}"]


def hook_job(seed: int, start: int | None, quick: bool,
             images: tuple[Path, int] | None = None,
             lm: tuple[Path, int, int] | None = None) -> dict[str, Any]:
    """One torchrun run of the anchor (``start`` None: plain DDP); ``images``: ResNet-18 on
    these images for this many steps; ``lm``: the GPT on this corpus for this many steps at
    this width; else the MNIST-1D CNN."""
    argv = [str(harness.python().parent / "torchrun"), "--standalone", "--nproc-per-node=2",
            str(Path(__file__).with_name("compression_hook.py")), "--seed", str(seed)]
    if start is not None:
        argv += ["--hook", "powersgd", "--start-iter", str(start)]
    if images is not None:
        epochs = image_budget(*images)[-1].split("=")[1]
        argv += ["--dataset", "images", "--images", str(images[0]), "--max-steps",
                 str(images[1]), "--epochs", epochs]
    elif lm is not None:
        epochs = lm_budget(*lm)[-1].split("=")[1]
        argv += ["--dataset", "lm", "--corpus", str(lm[0]), "--max-steps", str(lm[1]),
                 "--width", str(lm[2]), "--epochs", epochs]
    elif quick:
        argv += ["--epochs", "2"]
    harness.log(f"torchrun seed {seed}: {'DDP' if start is None else f'powerSGD_hook {start}'}")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode or not lines:
        raise harness.BenchError(f"torchrun failed ({out.returncode}): {out.stderr[-2000:]}")
    return lines[0]


def hvdtrain_job(framework: str, dataset: str, seed: int, names: Sequence[str], out: Path,
                 extra: Sequence[str], optimizer: str = "sgd") -> dict[str, Any]:
    """One seed's hvdtrain runs in one job; their records by variant, each with its eval curve."""
    records = comp.job(framework, dataset, seed, names, out, extra=extra, optimizer=optimizer)
    metric = comp.metric_of(dataset).name
    for r in records:
        r["curve"] = curve(out / f"{dataset}-{optimizer}-{r['method']}-s{seed}", metric)
    return {r["method"]: r for r in records}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every job; the records by seed."""
    names = variants(args.methods.split(","), [int(d) for d in args.dense.split(",")])
    names += [v for v in args.variants.split(",") if v]
    work = Path(args.work)
    images, lm = None, None
    if args.dataset == comp.IMAGES:
        images = (comp.make_image_set(work), 10 if args.quick else args.steps)
        extra = image_budget(*images)
    elif args.dataset == comp.LM:
        lm = (fixed_corpus(work), 20 if args.quick else args.steps, args.width)
        extra = lm_budget(*lm)
    else:
        extra = ["train.epochs=2"] if args.quick else []
    if args.hook_only and args.hook_starts == "none":
        raise harness.BenchError("--hook-only runs the anchor: give --hook-starts")
    if args.framework != "torch" and args.hook_starts != "none":
        raise harness.BenchError("--framework tensorflow has no anchor: add --hook-starts none")
    optimizer = args.optimizer or ("adam" if args.dataset == comp.LM else "sgd")
    out: dict[str, Any] = {"hvdtrain": {}, "hook": {}, "names": [] if args.hook_only else names,
                           "framework": args.framework, "dataset": args.dataset,
                           "optimizer": optimizer}
    for seed in range(args.seed_from, args.seed_from + args.seeds):
        if not args.hook_only:
            out["hvdtrain"][seed] = hvdtrain_job(args.framework, args.dataset, seed, names,
                                                 work / args.framework, extra, optimizer)
        starts: list[int | None] = [] if args.hook_starts == "none" else [
            None, *(int(s) for s in args.hook_starts.split(",") if s)]
        out["hook"][seed] = {("ddp" if s is None else f"hook{s}"):
                             hook_job(seed, s, args.quick, images, lm) for s in starts}
    return out


def merge(paths: Sequence[str]) -> dict[str, Any]:
    """The records of several ``--json`` files (jobs of other seeds, the same variants and
    framework; a ``--hook-only`` file adds its hook runs to its seeds)."""
    out: dict[str, Any] = {"hvdtrain": {}, "hook": {}, "names": [], "framework": None}
    for path in paths:
        data = json.loads(Path(path).read_text())
        fw = data.get("framework", "torch")  # files written before --framework: PyTorch's
        if data["hvdtrain"]:
            out["names"] = out["names"] or data["names"]
            out["framework"] = out["framework"] or fw
            out["dataset"] = data.get("dataset", DATASET)
            if (data["names"], fw) != (out["names"], out["framework"]):
                raise harness.BenchError(f"{path}: other variants or framework than the first's")
        out["hvdtrain"].update({int(s): r for s, r in data["hvdtrain"].items()})
        for s, r in data["hook"].items():
            out["hook"].setdefault(int(s), {}).update(r)
    out["framework"] = out["framework"] or "torch"
    return out


def fmt_interval(values: Sequence[float], scale: float = 100.0) -> str:
    mean, lo, hi = interval([v * scale for v in values])
    return f"{mean:+.2f} ({lo:+.2f} to {hi:+.2f})" if len(values) > 1 else f"{mean:+.2f}"


def against_hook(data: dict[str, Any], seeds: Sequence[int], hooks: Sequence[str]) -> str:
    """Lines pairing each hvdtrain PowerSGD variant with each hook start by seed: its accuracy
    less the hook's (positive: hvdtrain's is higher), mean and 95% interval, in points; for the
    GPT its perplexity over the hook's, less 1, in percent (negative: hvdtrain's is lower)."""
    lm = data.get("dataset") == comp.LM
    out = []
    for name in (n for n in data["names"] if n.split("+")[0] == "powersgd"):
        for hook in (h for h in hooks if h != "ddp"):
            ours = [data["hvdtrain"][s][name] for s in seeds]
            theirs = [data["hook"][s][hook] for s in seeds]
            diff = [a["perplexity"] / b["perplexity"] - 1 if lm else
                    a["accuracy"] - b["accuracy"] for a, b in zip(ours, theirs, strict=True)]
            what = "perplexity over" if lm else "less"
            out.append(f"- hvdtrain `{name}` {what} torch's powerSGD_hook start {hook[4:]}, by "
                       f"seed: {fmt_interval(diff)}{'%' if lm else ' points'} (per seed: "
                       f"{', '.join(f'{100 * d:+.1f}' for d in diff)})")
    return "\n\n" + "\n".join(out) if out else ""


def spread(points: Sequence[tuple[int, float]], lm: bool) -> float:
    """How far apart a curve's evaluations lie: points of accuracy, or for the GPT the highest
    perplexity over the lowest, less 1."""
    values = [a for _, a in points]
    return max(values) / min(values) - 1 if lm else max(values) - min(values)


def report(data: dict[str, Any], flat_epochs: int = FLAT_EPOCHS) -> str:
    """The section's tables; ``flat_epochs``: the last evaluations whose spread is printed."""
    seeds = sorted(data["hvdtrain"])
    lm = data.get("dataset") == comp.LM
    key, unit = ("perplexity", "%") if lm else ("accuracy", " points")
    lines = [f"| run | seeds | {'eval perplexity' if lm else 'accuracy'} | "
             f"{'increase vs none (%' if lm else 'loss vs none (points'}, 95% interval) | "
             "fewer bytes than dense (run total) | steps to none's final | modeled s to it at "
             "100 Mbit/s |", "|---|---:|---:|---:|---:|---:|---:|"]
    flat = [spread(data["hvdtrain"][s]["none"]["curve"][-flat_epochs:], lm) for s in seeds]
    label = "hvdtrain" + (" TensorFlow" if data.get("framework") == "tensorflow" else "")
    for name in data["names"]:
        rs = [data["hvdtrain"][s][name] for s in seeds]
        base = [data["hvdtrain"][s]["none"] for s in seeds]
        acc = [r[key] for r in rs]
        loss = [r[key] / b[key] - 1 if lm else b[key] - r[key]
                for b, r in zip(base, rs, strict=True)]
        reach = [steps_to(r["curve"], b[key], lm) for b, r in zip(base, rs, strict=True)]
        got = [x for x in reach if x is not None]
        secs = [x * (r["step_ms"] / 1e3 + r["wire_per_step"] / LINK_BYTES_PER_S)
                for x, r in zip(reach, rs, strict=True) if x is not None]
        lines.append(f"| {label} `{name}` | {len(rs)} | {statistics.mean(acc):.{2 if lm else 4}f}"
                     f" | {fmt_interval(loss) if name != 'none' else '—'} | "
                     f"{statistics.median(r['ratio'] for r in rs):.1f}x | " +
                     (f"{statistics.mean(got):.0f} ({len(got)}/{len(rs)} reach it)" if got else
                      "none reach it"))
        lines[-1] += f" | {statistics.mean(secs):.1f} |" if secs else " | — |"
    hooked = [s for s in seeds if data["hook"].get(s)]  # seeds whose anchor ran
    hooks = sorted({k for s in hooked for k in data["hook"][s]})
    for name in hooks:
        rs = [data["hook"][s][name] for s in hooked]
        base = [data["hook"][s]["ddp"] for s in hooked]
        loss = [r[key] / b[key] - 1 if lm else b[key] - r[key]
                for b, r in zip(base, rs, strict=True)]
        label = "torch DDP" if name == "ddp" else f"torch powerSGD_hook, start {name[4:]}"
        lines.append(f"| {label} | {len(rs)} | "
                     f"{statistics.mean(r[key] for r in rs):.{2 if lm else 4}f}"
                     f" | {fmt_interval(loss) + ' vs DDP' if name != 'ddp' else '—'} | — | — | — |")
    gap = [(data["hook"][s]["ddp"][key] / data["hvdtrain"][s]["none"][key] - 1) if lm else
           data["hook"][s]["ddp"][key] - data["hvdtrain"][s]["none"][key]
           for s in hooked if "ddp" in data["hook"][s]]
    return "\n".join(lines) + against_hook(data, hooked, hooks) + (
        f"\n\n`none` over its last {flat_epochs} evaluations moves at most "
        f"{100 * max(flat):.2f}{unit} (per seed: {', '.join(f'{100 * f:.2f}' for f in flat)})"
        + (f"; torch DDP against hvdtrain `none`, same seeds: {fmt_interval(gap)}{unit}"
           if gap else "") + ".\n")


def hook_lines(data: dict[str, Any]) -> str:
    """A ``--hook-only`` job's anchor runs, a line each (the report pairs them after ``--merge``)."""
    key = "perplexity" if data.get("dataset") == comp.LM else "accuracy"
    return "\n".join(f"seed {s} {name}: {key} {r[key]:.4f}"
                     for s, runs in sorted(data["hook"].items()) for name, r in runs.items())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seed-from", type=int, default=0,
                   help="the first seed (a measurement split into jobs of a seed each)")
    p.add_argument("--framework", choices=("torch", "tensorflow"), default="torch",
                   help="hvdtrain's runs' framework (tensorflow: --dataset images, no anchor)")
    p.add_argument("--dataset", choices=(DATASET, comp.IMAGES, comp.LM), default=DATASET,
                   help="images: ResNet-18 on generated images for --steps steps; lm: the "
                        "built-in GPT for --steps steps")
    p.add_argument("--steps", type=int, default=1000,
                   help="ResNet-18's or the GPT's steps (--dataset images, lm)")
    p.add_argument("--width", type=int, default=GPT_WIDTH,
                   help="the GPT's d_model (--dataset lm; configs/lm_torch.yaml's is 64)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="",
                   help="the runs' optimizer (default: the GPT's config's Adam, else SGD momentum)")
    p.add_argument("--flat-epochs", type=int, default=FLAT_EPOCHS,
                   help="the last evaluations of none whose spread the report prints")
    p.add_argument("--methods", default="topk,powersgd")
    p.add_argument("--dense", default="0,250",
                   help="comm.dense_steps values per method (-1: the config's default)")
    p.add_argument("--hook-starts", default="2,250",
                   help="start_powerSGD_iter values (empty: plain DDP only; none: no torchrun)")
    p.add_argument("--variants", default="",
                   help="more hvdtrain variants, e.g. topk+adaptive=true+dense_steps=100")
    p.add_argument("--hook-only", action="store_true",
                   help="the anchor's runs alone (merge them with the seeds' hvdtrain runs)")
    p.add_argument("--work", default="/tmp/hvdtrain-bench-convergence")
    p.add_argument("--quick", action="store_true", help="2 epochs, a check of the script")
    p.add_argument("--json", default="", help="also write the raw records here")
    p.add_argument("--merge", default="",
                   help="comma-separated --json files of earlier jobs: report them together, "
                        "run nothing")
    args = p.parse_args(argv)
    data = merge(args.merge.split(",")) if args.merge else run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(data, default=str))
    print(report(data, args.flat_epochs) if data["hvdtrain"] else hook_lines(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
