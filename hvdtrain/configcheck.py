"""Type and range checks for config values, kept apart so config.py reads as the reference."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import typing
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar, cast

from hvdtrain.errors import ConfigError

_Options = TypeVar("_Options")

INT_MAX = 2**31 - 1
"""The largest value of an integer key that sets no bound of its own. Counts and sizes reach C
ints (thread counts) and NumPy's int64, and a seed plus a rank must stay below 2**32 (NumPy's
seeds); a larger value would pass here and fail after the run started."""

_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
               dict: "a mapping", list: "a list"}


def nearest_key(key: str, known: Iterable[str], prefix: str = "") -> str:
    """A ``; did you mean ...`` hint for a misspelt key, listing the known keys otherwise."""
    known = sorted(known)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {prefix + close[0]!r}?"
    return f"; known keys under {prefix.rstrip('.') or 'the top level'}: {', '.join(known)}"


def coerce_value(path: str, value: Any, ftype: type) -> Any:
    """Returns ``value`` as ``ftype`` or raises naming the key, the value and the type wanted.

    Only lossless conversions happen: an int, or a string such as ``1e-3``, where a float is wanted.
    ``1.5`` for an int, ``"abc"`` for a number and ``1`` for a bool are all rejected, and so are
    NaN and the infinities (``.nan``, ``.inf``, ``1e999``) for a number: no key means anything by
    them.
    """
    if ftype is float:
        return _finite_float(path, value)
    ok = isinstance(value, ftype) and not (ftype is int and isinstance(value, bool))
    if not ok:
        wanted = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in typing.get_args(ftype)
                             or (ftype,))
        raise ConfigError(f"{path}={shown(value)}: expected {wanted}")
    if isinstance(value, str) and "\0" in value:  # no path or name can hold one
        raise ConfigError(f"{path}={shown(value)}: contains a NUL character")
    return value


def _finite_float(path: str, value: Any) -> float:
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value) if abs(value) < 1e308 else math.inf  # a huge int would overflow
    elif isinstance(value, str):
        # YAML 1.1 reads 1e-3 (no dot) as a string; a number written that way is still a number.
        with contextlib.suppress(ValueError):
            number = float(value)
    if number is None:
        raise ConfigError(f"{path}={shown(value)}: expected a number")
    if not math.isfinite(number):
        raise ConfigError(f"{path}={shown(value)}: expected a finite number, not NaN or infinity")
    return number


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut short so that the error stays one readable line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def check_section(obj: Any, prefix: str = "") -> None:
    """Checks every field of dataclass ``obj`` against its ``min``, ``max`` (for an integer
    without one, :data:`INT_MAX`) and ``choices``."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        path = f"{prefix}{f.name}"
        lo, hi, choices = (f.metadata.get(k) for k in ("min", "max", "choices"))
        if hi is None and isinstance(value, int) and not isinstance(value, bool):
            hi = INT_MAX
        if choices and value not in choices:
            raise ConfigError(f"{path}={shown(value)}: must be one of {', '.join(choices)}")
        if lo is not None and value < lo:
            raise ConfigError(f"{path}={shown(value)}: must be >= {lo}")
        if hi is not None and value > hi:
            raise ConfigError(f"{path}={shown(value)}: must be <= {hi}")


def changed_fields(settings: Any) -> dict[str, Any]:
    """The fields of a settings dataclass that differ from their defaults, by name: the keys a
    config sets (a file that spells out a default sets nothing)."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
            if getattr(settings, f.name) != _default(f)}


def field_default(settings: Any, name: str) -> Any:
    """The default of field ``name`` of a settings dataclass."""
    return _default(next(f for f in dataclasses.fields(settings) if f.name == name))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    factory = f.default_factory
    return factory() if callable(factory) else dataclasses.MISSING


def written(value: Any) -> str:
    """A value as a config file or an override writes it (``true``, ``0.5``, ``'lines'``)."""
    return str(value).lower() if isinstance(value, bool) else shown(value)


def refuse_unread(prefix: str, settings: Any, names: Iterable[str], given: str, why: str,
                  switch: str = "") -> None:
    """Raises one line naming the keys of section ``settings`` among ``names`` that are set away
    from their defaults, where ``given`` (the settings that leave them unread) holds: ``KEY=VALUE
    does nothing with GIVEN: WHY; set SWITCH or leave KEY at its default D``. A setting that
    would do nothing is refused rather than ignored (docs/configuration.md)."""
    wanted = set(names)
    changed = {name: value for name, value in changed_fields(settings).items() if name in wanted}
    if not changed:
        return
    keys = [f"{prefix}{name}={written(value)}" for name, value in changed.items()]
    if len(keys) == 1:
        name = next(iter(changed))
        leave = (f"leave {prefix}{name} at its default "
                 f"{written(field_default(settings, name))}")
        head = f"{keys[0]} does"
    else:
        defaults = ", ".join(f"{prefix}{name}={written(field_default(settings, name))}"
                             for name in changed)
        leave = f"leave them at their defaults ({defaults})"
        head = f"{', '.join(keys[:-1])} and {keys[-1]} do"
    fix = f"set {switch} or {leave}" if switch else leave
    raise ConfigError(f"{head} nothing with {given}: {why}; {fix}")


def options_of(cls: type[_Options], options: Mapping[str, Any], model: str) -> _Options:
    """``cls`` (the dataclass of built-in model ``model``'s options) made from
    ``model.options``; an unknown key is one line naming the known ones."""
    known = [f.name for f in dataclasses.fields(cast(Any, cls))]
    unknown = [key for key in options if key not in known]
    if unknown:
        raise ConfigError(f"model.options: unknown option(s) for {model}: {', '.join(unknown)} "
                          f"(known: {', '.join(known)})")
    return cls(**options)
