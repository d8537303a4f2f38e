"""The model profile: what the planner knows of a model, measured on one rank
(``hvdtrain plan profile``) or written from published figures (:mod:`hvdtrain.plan.published`).

A profile is JSON::

    {"format": "hvdtrain-plan-profile/1",
     "model": {"framework": "torch", "name": "mlp", "options": {"hidden": [128]}},
     "batch_size": 32,                       # samples per rank of the timed step
     "forward_s": 0.004, "backward_s": 0.008, "update_s": 0.001,
     "tensors": [{"name": "head.bias", "bytes": 40, "ready_s": 0.0003}, ...],
     "layers": [{"name": "fc1", "params": 8320, "forward_s": 0.001, "backward_s": 0.002,
                 "activation_bytes": 16384, "fixed_forward_s": 0.0002,
                 "fixed_backward_s": 0.0009}, ...],
     "compression": {"none": {"ratio": 1.0, "kernel_s": 0.0, "collective": "allreduce",
                              "settings": {"ratio": 0.01, "rank": 2, "min_size": 1024,
                                           "bucket": 512}}, ...},
     "source": "how the figures were obtained"}

``tensors`` lists the gradients in the order they become ready in the backward pass: ``ready_s``
is the time from the start of the backward pass to that gradient's readiness, ``bytes`` its float32
size. ``layers`` (optional; without it no pipeline setting applies) is the model's ordered layer
list with each layer's share of the step and the bytes of its output for the whole batch (what a
pipeline stage sends the next), and the part of each time that a smaller batch does not shrink
(optional, 0 by default; :func:`fixed_part` of the times at the batch and at a quarter of it), by
which the plan prices a pipeline's micro-batches. ``compression`` gives each method's ratio
(dense bytes / wire bytes), the time its kernels take per step on one rank, its collective, and
the ``comm`` settings the ratio was measured at (``settings``, optional).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hvdtrain.errors import ConfigError, os_failure

FORMAT = "hvdtrain-plan-profile/1"
COLLECTIVES = ("allreduce", "allgather")
RATIO_KEYS = ("ratio", "rank", "min_size", "bucket")
"""The ``comm`` keys a compression method's bytes ratio depends on (its plan's byte counts)."""


@dataclass(frozen=True)
class TensorProfile:
    """One gradient tensor: its float32 bytes and when it is ready in the backward pass."""

    name: str
    bytes: int
    ready_s: float


@dataclass(frozen=True)
class LayerProfile:
    """One layer of the model's ordered layer list."""

    name: str
    params: int
    forward_s: float
    backward_s: float
    activation_bytes: int
    """Bytes of the layer's output for the profile's whole batch."""
    fixed_forward_s: float = 0.0
    """The part of ``forward_s`` that a smaller batch does not shrink (:func:`fixed_part`; 0: the
    times scale with the batch, as for profiles written without it)."""
    fixed_backward_s: float = 0.0
    """The same for ``backward_s``: a weight gradient costs about the same at any batch."""

    def seconds(self, share: float, speed: float) -> tuple[float, float]:
        """Forward and backward seconds of ``share`` of the profile's batch on a rank of
        ``speed``: the fixed part whole, the rest by the share."""
        return ((self.fixed_forward_s + (self.forward_s - self.fixed_forward_s) * share) / speed,
                (self.fixed_backward_s + (self.backward_s - self.fixed_backward_s) * share) / speed)


def smaller_batch(batch: int) -> int:
    """The second batch the profilers time the layers at: a quarter of the batch."""
    return max(1, batch // 4)


def layer_profiles(names: list[str], params: list[int], timed: tuple[list, list, list],
                   small: tuple[list, list], batch: int, small_batch: int) -> list[LayerProfile]:
    """The layer list's profile from the profilers' medians: ``timed`` forward and backward
    seconds and output bytes per layer at ``batch``, ``small`` the seconds at ``small_batch``."""
    fwd, bwd, acts = timed
    return [LayerProfile(n, p, f, b, a, fixed_part(f, fs, batch, small_batch),
                         fixed_part(b, bs, batch, small_batch))
            for n, p, f, b, a, fs, bs in zip(names, params, fwd, bwd, acts, *small, strict=True)]


def fixed_part(seconds: float, small_seconds: float, batch: int, small_batch: int) -> float:
    """The intercept of the line through a layer's time at ``batch`` and at ``small_batch``,
    kept within ``[0, seconds]``: what a micro-batch pays whatever its size."""
    if small_batch >= batch:
        return 0.0
    slope = (seconds - small_seconds) / (batch - small_batch)
    return min(seconds, max(0.0, seconds - slope * batch))


@dataclass(frozen=True)
class MethodProfile:
    """One compression method as measured: bytes ratio, kernel time per step, collective."""

    ratio: float
    kernel_s: float
    collective: str = "allreduce"
    settings: dict[str, float] = field(default_factory=dict)
    """The ``comm`` keys the ratio was measured at (:data:`RATIO_KEYS`;
    empty in a profile written before they were recorded, and in the published ones)."""


@dataclass
class ModelProfile:
    """What the planner knows of a model (the module docstring gives the file's form)."""

    model: dict[str, Any]
    batch_size: int
    forward_s: float
    backward_s: float
    update_s: float
    tensors: list[TensorProfile]
    layers: list[LayerProfile] = field(default_factory=list)
    compression: dict[str, MethodProfile] = field(default_factory=dict)
    source: str = ""

    @property
    def name(self) -> str:
        """The model's name, for tables."""
        return str(self.model.get("name", "model"))

    @property
    def gradient_bytes(self) -> int:
        """Float32 bytes of every gradient (M in the formulas)."""
        return sum(t.bytes for t in self.tensors)

    @property
    def compute_s(self) -> float:
        """A step of one rank alone: forward, backward and update."""
        return self.forward_s + self.backward_s + self.update_s

    def to_dict(self) -> dict[str, Any]:
        """The profile as the JSON file holds it."""
        out = asdict(self)
        return {"format": FORMAT, **out}


def _number(where: str, key: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: {key}={value!r}: expected a finite number")
    if value < 0 or (positive and value == 0):
        raise ConfigError(f"{where}: {key}={value!r}: must be {'> 0' if positive else '>= 0'}")
    return float(value)


def _need(where: str, tree: dict, key: str) -> Any:
    if key not in tree:
        raise ConfigError(f"{where}: missing key {key!r}")
    return tree[key]


def _items(where: str, tree: dict, key: str, required: bool = True) -> list:
    value = _need(where, tree, key) if required else tree.get(key, [])
    if not isinstance(value, list) or (required and not value):
        raise ConfigError(f"{where}: {key} must be a non-empty list")
    return value


def _tensor(where: str, i: int, item: Any) -> TensorProfile:
    at = f"{where}: tensors[{i}]"
    if not isinstance(item, dict):
        raise ConfigError(f"{at}: expected a mapping")
    return TensorProfile(str(_need(at, item, "name")),
                         int(_number(at, "bytes", _need(at, item, "bytes"))),
                         _number(at, "ready_s", _need(at, item, "ready_s")))


def _layer(where: str, i: int, item: Any) -> LayerProfile:
    at = f"{where}: layers[{i}]"
    if not isinstance(item, dict):
        raise ConfigError(f"{at}: expected a mapping")
    nums = {k: _number(at, k, _need(at, item, k))
            for k in ("params", "forward_s", "backward_s", "activation_bytes")}
    fixed = {k: _number(at, k, item.get(k, 0.0)) for k in ("fixed_forward_s", "fixed_backward_s")}
    for key, whole in (("fixed_forward_s", "forward_s"), ("fixed_backward_s", "backward_s")):
        if fixed[key] > nums[whole]:
            raise ConfigError(f"{at}: {key}={fixed[key]!r}: must be <= {whole} ({nums[whole]!r})")
    return LayerProfile(str(_need(at, item, "name")), int(nums["params"]), nums["forward_s"],
                        nums["backward_s"], int(nums["activation_bytes"]),
                        fixed["fixed_forward_s"], fixed["fixed_backward_s"])


def _method(where: str, name: str, item: Any) -> MethodProfile:
    at = f"{where}: compression.{name}"
    if not isinstance(item, dict):
        raise ConfigError(f"{at}: expected a mapping")
    collective = item.get("collective", "allreduce")
    if collective not in COLLECTIVES:
        raise ConfigError(f"{at}.collective={collective!r}: must be one of {', '.join(COLLECTIVES)}")
    settings = item.get("settings", {})
    if not isinstance(settings, dict):
        raise ConfigError(f"{at}.settings: expected a mapping of comm keys")
    return MethodProfile(_number(at, "ratio", _need(at, item, "ratio"), positive=True),
                         _number(at, "kernel_s", _need(at, item, "kernel_s")), collective,
                         {str(k): _number(f"{at}.settings", str(k), v)
                          for k, v in settings.items()})


def profile_from_tree(tree: Any, where: str = "profile") -> ModelProfile:
    """A :class:`ModelProfile` from parsed JSON; a missing or impossible value is one
    :class:`ConfigError` naming the key."""
    if not isinstance(tree, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    if tree.get("format") != FORMAT:
        raise ConfigError(f"{where}: format={tree.get('format')!r}: expected {FORMAT!r} (write "
                          "one with hvdtrain plan profile)")
    model = _need(where, tree, "model")
    if not isinstance(model, dict) or "name" not in model:
        raise ConfigError(f"{where}: model must be a mapping with a name")
    methods = tree.get("compression", {})
    if not isinstance(methods, dict):
        raise ConfigError(f"{where}: compression must be a mapping of methods")
    return ModelProfile(
        model=model,
        batch_size=int(_number(where, "batch_size", _need(where, tree, "batch_size"), positive=True)),
        forward_s=_number(where, "forward_s", _need(where, tree, "forward_s")),
        backward_s=_number(where, "backward_s", _need(where, tree, "backward_s"), positive=True),
        update_s=_number(where, "update_s", tree.get("update_s", 0.0)),
        tensors=[_tensor(where, i, t) for i, t in enumerate(_items(where, tree, "tensors"))],
        layers=[_layer(where, i, x) for i, x in enumerate(_items(where, tree, "layers", False))],
        compression={str(k): _method(where, str(k), v) for k, v in methods.items()},
        source=str(tree.get("source", "")))


def load_profile(path: str | Path) -> ModelProfile:
    """Reads and checks a profile file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"profile {str(path)!r} not found")
    try:
        tree = json.loads(path.read_text())
    except OSError as exc:
        raise os_failure(exc, "cannot read the profile", path, "check its permissions") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"profile {path}: not valid JSON ({exc})") from None
    return profile_from_tree(tree, f"profile {path}")


def save_profile(profile: ModelProfile, path: str | Path) -> None:
    """Writes ``profile`` as JSON."""
    Path(path).write_text(json.dumps(profile.to_dict(), indent=1) + "\n")


def model_key(framework: str, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """How a profile names the model it measured: what must match the config it plans for."""
    return {"framework": framework, "name": name, "options": dict(options)}


def check_matches(profile: ModelProfile, framework: str, name: str, options: dict[str, Any]) -> None:
    """Raises a one-line error when ``profile`` was measured on another model than the config's."""
    want = model_key(framework, name, options)
    got = {k: profile.model.get(k) for k in want}
    if got != want:
        raise ConfigError(f"the profile is of another model ({json.dumps(got, sort_keys=True)}) "
                          f"than the config's ({json.dumps(want, sort_keys=True)}); profile this "
                          "config with hvdtrain plan profile")
