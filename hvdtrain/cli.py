"""The ``hvdtrain`` command: ``train`` and ``doctor``.

User errors (:class:`~hvdtrain.errors.HvdtrainError`) become one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from hvdtrain.errors import HvdtrainError

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hvdtrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train from a YAML config (run it under horovodrun for many ranks)")
    train.add_argument("config", help="YAML config file, e.g. configs/digits_torch.yaml")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="dotted overrides, e.g. train.epochs=3 optim.lr=0.1")
    doctor = sub.add_parser("doctor", help="check versions and Horovod's build")
    doctor.add_argument("--quiet", action="store_true", help="print problems only")
    return parser


def _train(args: argparse.Namespace) -> int:
    from hvdtrain.config import load_config
    from hvdtrain.trainer import train

    result = train(load_config(args.config, args.overrides))
    if result.engine.rank == 0:
        final = result.summary["final"]
        print(f"[hvdtrain] done: {result.summary['steps']} steps on {result.summary['world_size']} "
              f"rank(s), eval_accuracy={final.get('eval_accuracy', float('nan')):.4f}, "
              f"{result.summary['samples_per_sec']:.0f} samples/s; outputs in {result.run_dir}")
        print(json.dumps(result.summary, indent=2, sort_keys=True))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hvdtrain`` console script."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        from hvdtrain.doctor import doctor
        return doctor(quiet=args.quiet)
    except HvdtrainError as exc:
        print(f"hvdtrain: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
