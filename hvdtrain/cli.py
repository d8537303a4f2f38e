"""The ``hvdtrain`` command: train, data, slurm, report, plan, export and doctor.

Errors become one line on stderr and an exit code a job script can act on (docs/elastic.md,
"Exit codes"): 2 for a user error (:class:`~hvdtrain.errors.HvdtrainError`), 74 for a failing
environment (:class:`~hvdtrain.errors.EnvironmentFailure`, or any ``OSError``), 75 for a run
stopped on request.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
from collections.abc import Sequence

from hvdtrain.errors import EnvironmentFailure, HvdtrainError
from hvdtrain.loop import Stopped
from hvdtrain.signals import EXIT_RESUBMIT

EXIT_USAGE = 2
"""A mistake in the command or the config: fix it; resubmitting as is fails again."""
EXIT_ENVIRONMENT = 74
"""The environment failed the run (a full disk, an unwritable directory, an I/O error); what the run
saved stays valid: fix the cause, then resubmit with ``checkpoint.resume=auto``. 74 is
``EX_IOERR`` of sysexits.h."""
# Subcommands whose KEY=VALUE overrides may come before, between or after the options.
_WITH_OVERRIDES = ("train", "slurm", "plan")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hvdtrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train",
                           help="train from a YAML config (run it under horovodrun for many ranks)")
    train.add_argument("config", help="YAML config file, e.g. configs/digits_torch.yaml")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="dotted overrides, e.g. train.epochs=3 optim.lr=0.1")
    report = sub.add_parser("report", help="plot and tabulate one or more run directories")
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories to overlay")
    report.add_argument("--out", help="output directory (default: RUN_DIR/report of the first)")
    slurm = sub.add_parser("slurm", help="render, check or submit a Slurm job script "
                               "(template slurm/train.sbatch or elastic.sbatch)")
    slurm.add_argument("action", choices=("render", "check", "submit"))
    slurm.add_argument("config", help="YAML config file")
    slurm.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
    for flag, kind, default in (("--nodes", int, 1), ("--tasks-per-node", int, 1),
                                ("--time", str, "01:00:00"), ("--partition", str, ""),
                                ("--account", str, ""), ("--mem-per-cpu", str, ""),
                                ("--mem", str, ""),
                                ("--signal-lead", int, 120),
                                ("--controller", str, "gloo"), ("--launcher", str, "horovodrun"),
                                ("--gpus-per-node", int, 0), ("--min-nodes", int, 1),
                                ("--server-nodes", int, 0),
                                ("--network-interface", str, "")):
        slurm.add_argument(flag, type=kind, default=default, help=f"default: {default!r}")
    slurm.add_argument("--overcommit", action="store_true",
                       help="ask for the ranks as --ntasks with --overcommit (more ranks than "
                       "a node's CPUs; horovodrun only)")
    slurm.add_argument("--elastic", action="store_true",
                       help="render elastic.sbatch (elastic Horovod)")
    export = sub.add_parser("export", help="write a run's newest checkpoint as safetensors, a "
                            "transformers directory or a Keras file (docs/huggingface.md)")
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    export.add_argument("--format", required=True,
                        choices=("safetensors", "hf", "keras", "weights.h5"),
                        help="safetensors: OUT/model.safetensors; hf: a directory that "
                        "AutoModelForCausalLM.from_pretrained loads (model hf_causal_lm); "
                        "TensorFlow runs: keras (OUT/model.keras) or weights.h5 "
                        "(OUT/model.weights.h5)")
    export.add_argument("--out", help="output directory (default: RUN_DIR/export-FORMAT)")
    doctor = sub.add_parser("doctor", help="check versions and Horovod's build")
    doctor.add_argument("--quiet", action="store_true", help="print problems only")
    _plan_parser(sub)
    data = sub.add_parser("data", help="data set tools: make-images writes a class-per-folder "
                                       "JPEG set, make-text a tokenized text corpus")
    tools = data.add_subparsers(dest="action", required=True)
    images = tools.add_parser("make-images", help="a class-per-folder JPEG set of ten shapes")
    images.add_argument("dir",
                        help="output directory (DIR/train/<class>/*.jpg, DIR/test/<class>/*.jpg)")
    for flag, default in (("--train", 5000), ("--test", 1000), ("--size", 32), ("--seed", 0)):
        images.add_argument(flag, type=int, default=default, help=f"default: {default}")
    text = tools.add_parser("make-text", help="a tokenized corpus (train.bin, val.bin, "
                                              "meta.json) of text files, for data.name=text")
    text.add_argument("sources", nargs="+", metavar="SRC", help="text files, in corpus order")
    text.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    text.add_argument("--val-fraction", type=float, default=0.1,
                      help="the last this fraction of the tokens is val.bin (default: 0.1)")
    text.add_argument("--tokenizer", default="bytes",
                      help="bytes (default: a token a byte), bpe (a byte-level BPE trained on the "
                      "files, --vocab-size tokens), or a tokenizer.json or sentencepiece .model "
                      "file; saved beside the ids (docs/huggingface.md)")
    text.add_argument("--vocab-size", type=int, default=0,
                      help="--tokenizer bpe: the tokens of the trained BPE (e.g. 8192)")
    return parser


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="predict step time and scaling of every setting on a "
                          "cluster file; 'plan profile CONFIG --out P.json' measures a profile, "
                          "'plan calibrate --out C.yaml' (2+ ranks) a cluster file")
    plan.add_argument("overrides", nargs="*", metavar="[profile|calibrate] [CONFIG] [KEY=VALUE]",
                      help="'profile' or 'calibrate' to measure; the config file; dotted overrides")
    plan.add_argument("--cluster", help="cluster file (YAML; see docs/planner.md)")
    plan.add_argument("--profile", help="model profile (JSON) written by 'hvdtrain plan profile'"
                      " (default: profile CONFIG's model now)")
    plan.add_argument("--json", help="write the plan as JSON to this file")
    plan.add_argument("--html", help="write a self-contained page with the curves and time-lines")
    plan.add_argument("--plot", help="write the scaling curves as an image (PNG, SVG, PDF)")
    plan.add_argument("--out", help="plan profile: the profile (JSON) to write; plan calibrate: "
                      "the cluster file (YAML)")


def _plan(args: argparse.Namespace) -> int:
    from hvdtrain.plan.cluster import Cluster
    from hvdtrain.plan.command import Request, run
    from hvdtrain.plan.profile import ModelProfile

    result = run(Request(args.overrides, args.cluster, args.profile, args.json, args.html,
                         args.plot, args.out))
    if isinstance(result, ModelProfile):
        print(f"[hvdtrain] wrote the profile of {result.name} to {args.out}")
    elif isinstance(result, Cluster):
        print(f"[hvdtrain] wrote the cluster file {args.out}: {result.inter.bandwidth_gbit_s:.3f} "
              f"Gbit/s, {result.inter.latency_us:.1f} us, {result.message_overhead_us:.1f} us "
              "per collective")
    return 0


def _data(args: argparse.Namespace) -> int:
    if args.action == "make-text":
        return _make_text(args)
    from hvdtrain.data.make_images import make_images

    root = make_images(args.dir, args.train, args.test, args.size, args.seed)
    print(f"[hvdtrain] wrote {args.train} training and {args.test} test images of {args.size}x"
          f"{args.size} pixels, 10 classes, to {root}; train on them with data.options.root={root}")
    return 0


def _make_text(args: argparse.Namespace) -> int:
    """``data make-text``: byte tokens, or a real tokenizer's (:mod:`hvdtrain.data.hf_text`)."""
    if args.tokenizer == "bytes":
        from hvdtrain.data.text import make_text

        if args.vocab_size:
            raise HvdtrainError("data make-text: --vocab-size is for --tokenizer bpe")
        meta = make_text(args.sources, args.out, args.val_fraction)
        kind = "byte tokens"
    else:
        from hvdtrain.data.hf_text import make_tokenized_text

        meta = make_tokenized_text(args.sources, args.out, args.val_fraction, args.tokenizer,
                                   args.vocab_size or None)
        kind = f"tokens ({meta['tokenizer_file']}, {meta['vocab_size']} ids)"
    print(f"[hvdtrain] wrote {meta['train_tokens']} training and {meta['val_tokens']} "
          f"validation {kind} of {len(args.sources)} file(s) to {args.out}; train on "
          f"them with data.name=text data.options.root={args.out}")
    return 0


def _headline(final: dict[str, float]) -> str:
    """The final evaluation's figure that says how good the model is: a classifier's accuracy, a
    language model's perplexity, else the loss (``nan`` when the run never evaluated)."""
    for key in ("eval_accuracy", "eval_perplexity", "eval_loss"):
        if key in final:
            return f"{key}={final[key]:.4f}"
    return "eval_loss=nan"


def _train(args: argparse.Namespace) -> int:
    from hvdtrain.config import load_config
    from hvdtrain.driver import train

    result = train(load_config(args.config, args.overrides))
    if result.engine is not None and result.engine.rank == 0:
        print(f"[hvdtrain] done: {result.summary['steps']} steps on {result.summary['world_size']} "
              f"rank(s), {_headline(result.summary['final'])}, "
              f"{result.summary['samples_per_sec']:.0f} samples/s; outputs in {result.run_dir}")
        print(json.dumps(result.summary, indent=2, sort_keys=True))
    return 0


def _slurm(args: argparse.Namespace) -> int:
    from hvdtrain import slurm

    options = slurm.JobOptions(nodes=args.nodes, tasks_per_node=args.tasks_per_node, time=args.time,
                               partition=args.partition, account=args.account,
                               mem_per_cpu=args.mem_per_cpu, mem=args.mem,
                               overcommit=args.overcommit, signal_lead=args.signal_lead,
                               controller=args.controller,
                               launcher=args.launcher, gpus_per_node=args.gpus_per_node,
                               elastic=args.elastic, min_nodes=args.min_nodes,
                               server_nodes=args.server_nodes,
                               network_interface=args.network_interface)
    if args.action == "render":
        print(slurm.render(args.config, args.overrides, options), end="")
        return 0
    if args.action == "submit":
        slurm.submit(args.config, args.overrides, options)
        return 0
    problems = slurm.check(args.config, args.overrides, options)
    for problem in problems:
        print(f"hvdtrain: slurm check: {problem}", file=sys.stderr)
    print(f"[hvdtrain] {len(problems)} problem(s)" if problems else "[hvdtrain] slurm check: ok")
    return EXIT_USAGE if problems else 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the command line; ``train`` and ``slurm`` take their KEY=VALUE overrides anywhere
    after the config file, also after options (``--nodes 2 log.dir=X``), in the order given."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command in _WITH_OVERRIDES:
        overrides = [item for item in extra if "=" in item and not item.startswith("-")]
        args.overrides = [*args.overrides, *overrides]
        extra = [item for item in extra if item not in overrides]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _os_error_line(exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno or 0, "")
    where = f": {exc.filename!r}" if exc.filename else ""
    return f"{exc.strerror or exc} ({code}){where}" if code else f"{exc.strerror or exc}{where}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hvdtrain`` console script."""
    args = parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "report":
            from hvdtrain.observe.report import report
            print(f"[hvdtrain] report written to {report(args.run_dirs, args.out)}")
            return 0
        if args.command == "slurm":
            return _slurm(args)
        if args.command == "data":
            return _data(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "export":
            from hvdtrain.export import export
            print(f"[hvdtrain] exported to {export(args.run_dir, args.format, args.out)}")
            return 0
        from hvdtrain.doctor import doctor
        return doctor(quiet=args.quiet)
    except EnvironmentFailure as exc:
        print(f"hvdtrain: error: {exc}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    except HvdtrainError as exc:
        print(f"hvdtrain: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # a failure of the machine that no code above named more precisely
        print(f"hvdtrain: error: {_os_error_line(exc)}; fix the cause and run again "
              "(checkpoint.resume=auto continues a run)", file=sys.stderr)
        return EXIT_ENVIRONMENT
    except Stopped as stop:
        print(f"hvdtrain: {stop}; resubmit with checkpoint.resume=auto to continue",
              file=sys.stderr)
        return EXIT_RESUBMIT


if __name__ == "__main__":
    sys.exit(main())
