"""The ``comm`` section's own values: the compression methods (:data:`METHODS`) and which ``comm``
settings take effect with which method, optimizer and topology. One rule, used by the config's
validation (:func:`check_comm`) and by the exchange when it picks its update rule
(:func:`dgc_misfit` and :func:`adam_misfit`, in :func:`hvdtrain.compression.rules.make_rule`).
It sits beside the ring strategy (:mod:`hvdtrain.strategies.ring`), whose compressing exchange
reads the section, so that :mod:`hvdtrain.config` checks it without importing
:mod:`hvdtrain.compression`.

A setting that would do nothing in the combination given is refused with one line naming the keys
and the reason, when the config is validated (before any process group starts), whatever the
topology and with pipeline stages too:

- the update rules: ``comm.momentum_correction`` (DGC) needs ``topk`` or ``randomk``, SGD with
  momentum and error feedback; ``comm.compress_momentum`` needs ``topk``, ``randomk`` or ``qsgd``
  with Adam or AdamW; both run in the ring's compressing exchange only, not with parameter servers;
- their sub-keys (DGC's ``momentum_masking``, ``clip_norm``, ``sparsity_warmup_steps``) set away
  from their defaults while the rule is off;
- a method's parameters (``ratio``, ``rank``, ``bucket``, ``min_size``, ``error_feedback=false``,
  ``dense_steps``, ``dense_fraction``, ``dense_min_steps``) set away from their defaults with a
  method that does not read them, and the dense start's keys with parameter servers (their codec
  compresses from the first step); ``dense_fraction`` or ``dense_min_steps`` with
  ``dense_steps`` set (a count wins over the fraction and its floor);
- ``comm.adaptive`` (Accordion's switch) with a method other than ``topk``, ``randomk`` and
  ``powersgd``, with parameter servers or with an update rule, and its sub-keys while it is off;
- compressed Adam without a dense start (``dense_steps=0``, or ``dense_fraction=0`` and
  ``dense_min_steps=0`` where ``dense_steps`` is -1: its variance is estimated there);
- the keys that ``dense_steps`` replaced (:data:`RETIRED_KEYS`), with a line naming it.

Framework-free and feature-free, and free of :mod:`hvdtrain.config` (which calls it): the defaults
are read from the settings' own dataclass fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from hvdtrain.errors import ConfigError

METHODS: tuple[str, ...] = ("none", "fp16", "topk", "randomk", "qsgd", "powersgd")
"""The ``comm.compression`` methods, in the order they are documented: the one place their names
live (:data:`hvdtrain.compression.PLANS` registers a plan under each, and a unit test checks
that the two agree)."""

DGC_METHODS = ("topk", "randomk")
"""The methods that take DGC's momentum correction with SGD momentum."""
ADAM_METHODS = ("topk", "randomk", "qsgd")
"""The methods that compress Adam's momentum (1-bit Adam's design) with Adam and AdamW."""
ADAM_OPTIMIZERS = ("adam", "adamw")
"""The optimizers whose momentum ``comm.compress_momentum`` compresses."""

METHOD_KEYS = {
    "ratio": ("topk", "randomk"),
    "rank": ("powersgd",),
    "bucket": ("qsgd",),
    "min_size": ("topk", "randomk", "qsgd", "powersgd"),
    "error_feedback": ("topk", "randomk", "powersgd"),
    "dense_steps": ("topk", "randomk", "qsgd", "powersgd"),
    "dense_fraction": ("topk", "randomk", "qsgd", "powersgd"),
    "dense_min_steps": ("topk", "randomk", "qsgd", "powersgd"),
}
"""Per ``comm`` key, the methods that read it (``none`` and ``fp16`` send every tensor whole; qsgd
keeps no residual)."""
RULE_KEYS = {"momentum_masking": "momentum_correction", "clip_norm": "momentum_correction",
             "sparsity_warmup_steps": "momentum_correction", "adaptive_interval": "adaptive",
             "adaptive_threshold": "adaptive", "adaptive_factor": "adaptive"}
"""The keys read only by an update rule (or the adaptive switch), and the key that turns it on."""
ADAPTIVE_METHODS = ("topk", "randomk", "powersgd")
"""The methods whose level ``comm.adaptive`` switches (a ratio or a rank)."""
RETIRED_KEYS = {
    "comm.adam_warmup_steps": "comm.adam_warmup_steps is gone: compressed Adam's dense warm-up is "
                              "the dense start of every method, comm.dense_steps (at least 1 "
                              "with comm.compress_momentum=true)",
}
"""Keys that a newer key replaced, and the one line that refuses each (the config's loader
raises it in place of "unknown key")."""


class CommSettings(Protocol):
    """The ``comm`` settings checked here (:class:`hvdtrain.config.CommConfig` has them)."""

    compression: str
    error_feedback: bool
    momentum_correction: bool
    compress_momentum: bool
    dense_steps: int
    dense_fraction: float
    dense_min_steps: int
    adaptive: bool
    topology: str


class OptimSettings(Protocol):
    """The ``optim`` settings the update rules depend on (:class:`hvdtrain.config.OptimConfig`)."""

    name: str
    momentum: float


def dgc_misfit(method: str, error_feedback: bool, optimizer: str, momentum: float) -> str | None:
    """Why DGC's momentum correction does nothing with this ``comm.compression``,
    ``comm.error_feedback``, optimizer (``sgd``, ``adam``, ``adamw``) and SGD momentum, as the
    end of a one-line error; None where it runs (on the ring)."""
    if method not in DGC_METHODS:
        return (f"comm.compression={method!r}: DGC corrects the momentum of sparsified "
                "gradients, topk and randomk only")
    if optimizer != "sgd":
        return (f"optim.name={optimizer!r}: DGC corrects SGD momentum (comm.compress_momentum is "
                "Adam's)")
    if not momentum > 0:
        return f"optim.momentum={momentum:g}: DGC corrects SGD momentum, and there is none"
    if not error_feedback:
        return ("comm.error_feedback=false: DGC accumulates the velocity in the error-feedback "
                "residual")
    return None


def adam_misfit(method: str, error_feedback: bool, optimizer: str) -> str | None:
    """Why compressing Adam's momentum does nothing with this ``comm.compression``,
    ``comm.error_feedback`` and optimizer, as the end of a one-line error; None where it runs (on
    the ring)."""
    if method not in ADAM_METHODS:
        return (f"comm.compression={method!r}: compressed momentum is sent by topk, randomk and "
                "qsgd only")
    if optimizer not in ADAM_OPTIMIZERS:
        return (f"optim.name={optimizer!r}: it compresses Adam's and AdamW's momentum "
                "(comm.momentum_correction is SGD's)")
    if not error_feedback:
        return ("comm.error_feedback=false: compressed Adam always keeps error feedback "
                "(1-bit Adam's error compensation)")
    return None


def check_comm(comm: CommSettings, optim: OptimSettings) -> None:
    """Raises a one-line :class:`ConfigError` for a ``comm`` setting that would do nothing with
    the rest of ``comm`` and ``optim`` (see the module docstring). ``comm`` is a dataclass
    instance: a key counts as set where it differs from its field's default."""
    method, feedback = comm.compression, comm.error_feedback
    rules = {"momentum_correction": dgc_misfit(method, feedback, optim.name, optim.momentum),
             "compress_momentum": adam_misfit(method, feedback, optim.name)}
    for rule, misfit in rules.items():
        if getattr(comm, rule) and comm.topology != "ring":
            misfit = (f"comm.topology={comm.topology!r}: the update rules run in the ring's "
                      "compressing exchange, and parameter servers only sum gradients")
        if getattr(comm, rule) and misfit is not None:
            raise ConfigError(f"comm.{rule}=true does nothing with {misfit}")
    if comm.adaptive:
        _check_adaptive(comm)
    changed, defaults = _changed(comm), _defaults(comm)
    _check_dense_start(comm, changed, defaults)
    for key, rule in RULE_KEYS.items():
        if key in changed and not getattr(comm, rule):
            raise ConfigError(f"comm.{key}={_shown(changed[key])} does nothing with comm.{rule}="
                              f"false: only that rule reads it; set comm.{rule}=true or leave "
                              f"comm.{key} at its default {_shown(defaults[key])}")
    for key, methods in METHOD_KEYS.items():
        if key in changed and method not in methods:
            raise ConfigError(f"comm.{key}={_shown(changed[key])} does nothing with "
                              f"comm.compression={method!r}: only {_listed(methods)} read it; "
                              f"leave it at its default {_shown(defaults[key])}")


def _check_dense_start(comm: CommSettings, changed: dict[str, Any], defaults: dict[str, Any]
                       ) -> None:
    """Refuses a dense start that compressed Adam cannot warm up in, one on parameter servers,
    and ``dense_fraction`` or ``dense_min_steps`` beside a ``dense_steps`` count (which wins)."""
    if comm.compress_momentum and (comm.dense_steps == 0 or (
            comm.dense_steps < 0 and not comm.dense_fraction > 0 and comm.dense_min_steps < 1)):
        raise ConfigError("comm.compress_momentum=true needs a dense start (comm.dense_steps >= 1, "
                          "or -1 with comm.dense_fraction > 0 or comm.dense_min_steps >= 1): "
                          "compressed Adam estimates its variance in the dense steps, then "
                          "freezes it")
    for key in ("dense_steps", "dense_fraction", "dense_min_steps"):
        if key in changed and comm.topology != "ring":
            raise ConfigError(f"comm.{key}={changed[key]!r} does nothing with "
                              f"comm.topology={comm.topology!r}: the parameter servers' codec "
                              "compresses from the first step; leave it at its default "
                              f"{defaults[key]!r}")
    for key in ("dense_fraction", "dense_min_steps"):
        if key in changed and comm.dense_steps >= 0:
            raise ConfigError(f"comm.{key}={changed[key]!r} does nothing with "
                              f"comm.dense_steps={comm.dense_steps}: a count of dense steps wins "
                              "over the fraction and its floor; set comm.dense_steps=-1 to use "
                              "them")


def _check_adaptive(comm: CommSettings) -> None:
    """Refuses ``comm.adaptive=true`` where the switch would not run."""
    why = None
    if comm.compression not in ADAPTIVE_METHODS:
        why = (f"comm.compression={comm.compression!r}: it switches a ratio or a rank, "
               f"{_listed(ADAPTIVE_METHODS)} only")
    elif comm.topology != "ring":
        why = (f"comm.topology={comm.topology!r}: it runs in the ring's compressing exchange, "
               "and the parameter servers' codec keeps one level")
    elif comm.momentum_correction or comm.compress_momentum:
        rule = "momentum_correction" if comm.momentum_correction else "compress_momentum"
        why = f"comm.{rule}=true: it switches plain averaging's level, not an update rule's"
    if why is not None:
        raise ConfigError(f"comm.adaptive=true does nothing with {why}")


def _defaults(settings: Any) -> dict[str, Any]:
    """The defaults of a settings dataclass's fields, by name."""
    return {f.name: f.default for f in dataclasses.fields(settings)
            if f.default is not dataclasses.MISSING}


def _changed(settings: Any) -> dict[str, Any]:
    """The fields of a settings dataclass that differ from their defaults, by name."""
    return {name: getattr(settings, name) for name, default in _defaults(settings).items()
            if getattr(settings, name) != default}


def _shown(value: Any) -> str:
    """A value as a config file writes it (``true``, ``0.05``, ``'topk'``)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _listed(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
