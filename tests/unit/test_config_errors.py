"""The config loader never fails with a traceback: every key, given a value of every YAML type or an
edge value, in the file, in an override or in the environment, either loads (and then holds what
its type promises) or raises one ``ConfigError`` of one line; the CLI turns that into exit code 2.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import faulthandler
import math
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvdtrain.cli import EXIT_ENVIRONMENT, EXIT_USAGE, parse_args
from hvdtrain.config import Config, load_config
from hvdtrain.errors import ConfigError
from tests.conftest import CONFIG, ROOT, TF_CONFIG, run_env

# Bounded and derandomized: the same examples on every run, and no database in the checkout.
PROPERTY = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def keys(cls: type = Config, prefix: str = "") -> dict[str, type]:
    """Every dotted key of the config (sections too) and its type."""
    out: dict[str, type] = {}
    for name, ftype in typing.get_type_hints(cls).items():
        out[prefix + name] = ftype
        if dataclasses.is_dataclass(ftype):
            out |= keys(ftype, f"{prefix}{name}.")
    return out


KEYS = keys()
EDGE_VALUES = [None, True, False, 0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**63, -(2**63), 10**30, 10**400,
               0.0, -0.0, 1e-320, 1e6, 1e6 + 1, 9.3e9, 1e300, 1e308,
               float("nan"), float("inf"), float("-inf"), "", " ", "nan", "inf", "-Infinity",
               "1e999", "0x10", "a\0b", "\u00e9t\u00e9", "x" * 5000, [], [1, [2]], {}, {"a": {"b": {}}},
               {"nested": [None, 1.5]}]
YAML_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=10**300)
    | st.integers(min_value=2**31 - 8, max_value=2**64)  # huge but finite: past C ints and seeds
    | st.floats(allow_nan=True, allow_infinity=True) | st.floats(min_value=1e5, max_value=1e308)
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6)


def check_loaded_or_one_line_error(load: typing.Callable[[], Config]) -> None:
    """The loader either returns a config whose numbers are finite and usable where the run
    hands them over (:func:`check_usable`) or raises one line."""
    try:
        cfg = load()
    except ConfigError as exc:
        message = str(exc)
        assert message and "\n" not in message and len(message) < 1000, message
        return
    for key, ftype in KEYS.items():
        if ftype is float:
            value = _get(cfg, key)
            assert isinstance(value, float) and math.isfinite(value), (key, value)
        if ftype is int:
            value = _get(cfg, key)
            assert np.int32(value) == value, (key, value)  # fits a C int, and so NumPy's int64
    check_usable(cfg)


def check_usable(cfg: Config) -> None:
    """The consumers of the values that once crashed a started run accept what the loader let
    through (those that need no framework: seeds reach NumPy, the stall timeout Python's timer)."""
    np.random.seed(cfg.seed + 1023)  # rank r seeds with seed + r
    timeout = cfg.train.stall_timeout_s
    if timeout > 0:  # what the watchdog arms (hvdtrain.observe.watchdog: timeout + 2 grace + 5 s)
        faulthandler.dump_traceback_later(timeout + 2 * 15.0 + 5, exit=False)
        faulthandler.cancel_dump_traceback_later()
    assert math.isfinite(float(f"{cfg.comm.cycle_time_ms:g}"))  # HOROVOD_CYCLE_TIME, as Horovod reads it
    assert cfg.comm.cycle_time_ms <= 1000.0


def _get(cfg: Config, dotted: str) -> typing.Any:
    node: typing.Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def as_override(key: str, value: typing.Any) -> str:
    """``key=value`` with the value written as YAML on one line, as a user would type it."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9)
    return f"{key}={text.removesuffix(chr(10) + '...' + chr(10)).strip()}"


def as_file(tmp_path: Path, key: str, value: typing.Any) -> Path:
    """A config file that sets the dotted ``key`` to ``value``."""
    tree: dict = {}
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.mark.parametrize("key", sorted(KEYS))
def test_every_key_with_every_edge_value_loads_or_gives_one_line(key, tmp_path):
    for value in EDGE_VALUES:
        override = as_override(key, value)
        check_loaded_or_one_line_error(lambda o=override: load_config(None, [o], environ={}))
        path = as_file(tmp_path, key, value)
        check_loaded_or_one_line_error(lambda p=path: load_config(p, [], environ={}))


@pytest.mark.parametrize("key", sorted(k for k, t in KEYS.items() if t is float))
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan", "inf", "1e999", str(10**400)])
def test_every_float_key_refuses_nan_and_infinities(key, value):
    with pytest.raises(ConfigError, match="expected a finite number"):
        load_config(None, [f"{key}={value}"], environ={})


@PROPERTY
@given(key=st.sampled_from(sorted(KEYS)), value=YAML_VALUES)
def test_any_yaml_value_in_an_override_or_a_file_loads_or_gives_one_line(key, value, tmp_path_factory):
    check_loaded_or_one_line_error(lambda: load_config(None, [as_override(key, value)], environ={}))
    path = as_file(tmp_path_factory.mktemp("cfg"), key, value)
    check_loaded_or_one_line_error(lambda: load_config(path, [], environ={}))


@PROPERTY
@given(key=st.sampled_from(sorted(KEYS)), raw=st.text(max_size=40))
def test_any_text_typed_on_the_command_line_or_in_the_environment_loads_or_gives_one_line(key, raw):
    check_loaded_or_one_line_error(lambda: load_config(None, [f"{key}={raw}"], environ={}))
    if "\0" not in raw:  # the environment cannot hold one
        env = {"HVDTRAIN_" + key.upper().replace(".", "__"): raw}
        check_loaded_or_one_line_error(lambda: load_config(None, [], environ=env))


@PROPERTY
@given(text=st.text(max_size=200) | st.binary(max_size=200))
def test_any_config_file_content_loads_or_gives_one_line(text, tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "cfg.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    check_loaded_or_one_line_error(lambda: load_config(path, [], environ={}))


def hvdtrain(*args: str) -> subprocess.CompletedProcess:
    """The CLI as a user runs it (these runs stop at the config: no framework is loaded)."""
    return subprocess.run([sys.executable, "-m", "hvdtrain.cli", *args], cwd=ROOT, env=run_env(),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("override, message", [
    ("optim.lr=nan", "optim.lr='nan': expected a finite number"),
    ("optim.lr=.inf", "optim.lr=inf: expected a finite number"),
    ("train.stall_timeout_s=-.inf", "train.stall_timeout_s=-inf: expected a finite number"),
    ("comm.ratio=1e999", "comm.ratio='1e999': expected a finite number"),
    ("data.batch_size=[1]", "data.batch_size=[1]: expected an integer"),
    # Huge but finite: each once passed, then failed after the run had started.
    ("seed=4294967296", "seed=4294967296: must be <= 2147483647"),
    ("train.threads=1000000000000000000000000000000", "train.threads=1000000000000000000000000000000: "
     "must be <= 2147483647"),
    ("train.stall_timeout_s=1e10", "train.stall_timeout_s=10000000000.0: must be <= 1000000.0"),
    ("comm.cycle_time_ms=1e300", "comm.cycle_time_ms=1e+300: must be <= 1000.0"),
    ("log.dir={a: {b: 1}}", "log.dir={'a': {'b': 1}}: expected a string"),
    # Settings that would do nothing (hvdtrain.strategies.comm, OptimConfig).
    ("comm.momentum_correction=true", "comm.momentum_correction=true does nothing with "
     "comm.compression='none'"),
    (("comm.compression=qsgd", "comm.ratio=0.1"), "comm.ratio=0.1 does nothing with "
     "comm.compression='qsgd'"),
    ("optim.scale_lr=false", "optim.warmup_steps=20 does nothing with optim.scale_lr=false"),
])
def test_the_cli_turns_bad_values_into_one_line_and_exit_2(override, message, tmp_path):
    overrides = (override,) if isinstance(override, str) else override
    proc = hvdtrain("train", str(CONFIG), f"log.dir={tmp_path / 'run'}", *overrides)
    assert proc.returncode == EXIT_USAGE, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hvdtrain: error: {message}"), proc.stderr


@pytest.mark.parametrize("overrides", [
    ["framework=tensorflow", "train.precision=fp16", "comm.compression=topk"],
    ["framework=tensorflow", "train.precision=fp16", "comm.compression=powersgd"],
    ["framework=tensorflow", "train.precision=fp16", "comm.compression=qsgd"],
    ["framework=torch", "train.precision=fp16", "comm.compression=powersgd"],
])
def test_fp16_with_every_compression_loads_in_both_frameworks(overrides):
    """Both engines unscale before an exchange that keeps state between steps (hvdtrain.step)."""
    cfg = load_config(None, overrides, environ={})
    assert cfg.comm.compression == overrides[2].split("=")[1]


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_sgd_momentum_with_adam_is_refused_unless_left_at_its_default(name):
    for momentum in (0.0, 0.5, 0.99):
        with pytest.raises(ConfigError) as info:
            load_config(None, [f"optim.name={name}", f"optim.momentum={momentum}"], environ={})
        assert str(info.value) == (
            f"optim.momentum={momentum:g} does nothing with optim.name={name!r}: only SGD has "
            "momentum (Adam's betas are fixed at 0.9 and 0.999); leave it at its default 0.9")
    assert load_config(None, [f"optim.name={name}", "optim.momentum=0.9"], environ={}).optim.name == name
    assert load_config(None, ["optim.name=sgd", "optim.momentum=0"], environ={}).optim.momentum == 0


def test_a_warm_up_without_lr_scaling_is_refused():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["optim.warmup_steps=5", "optim.scale_lr=false"], environ={})
    assert str(info.value) == (
        "optim.warmup_steps=5 does nothing with optim.scale_lr=false: the warm-up rises from "
        "optim.lr to the scaled rate, which is optim.lr itself; set optim.warmup_steps=0")
    for overrides in (["optim.warmup_steps=5"], ["optim.warmup_steps=0", "optim.scale_lr=false"]):
        load_config(None, overrides, environ={})


def test_slurm_submit_with_log_dir_naming_a_file_is_the_user_error_train_gives(tmp_path):
    target = tmp_path / "afile"
    target.write_text("mine\n")
    expected = (f"hvdtrain: error: log.dir: cannot write the run directory {str(target)!r}: File "
                "exists (EEXIST); log.dir must name a directory (or where one can be made)")
    submit = ["slurm", "submit", str(CONFIG), "--nodes", "1", "--tasks-per-node", "2"]
    for args in (submit, ["train", str(CONFIG)]):
        proc = hvdtrain(*args, f"log.dir={target}")  # submit stops before sbatch: nothing is queued
        assert proc.returncode == EXIT_USAGE and proc.stderr.strip() == expected, proc.stderr
    assert target.read_text() == "mine\n"


def test_a_config_file_that_is_not_text_gives_one_line_and_exit_2(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    proc = hvdtrain("train", str(path))
    assert proc.returncode == EXIT_USAGE
    assert proc.stderr.strip() == (f"hvdtrain: error: config file {str(path)!r} is not UTF-8 text "
                                   "(invalid start byte at byte 0)")


def test_overrides_are_taken_before_between_and_after_the_options():
    args = parse_args(["slurm", "submit", "c.yaml", "a=1", "--nodes", "1", "b=2",
                       "--tasks-per-node", "2", "log.dir=X"])
    assert args.overrides == ["a=1", "b=2", "log.dir=X"]
    assert (args.nodes, args.tasks_per_node) == (1, 2)
    assert parse_args(["train", "c.yaml", "x=1", "y=2"]).overrides == ["x=1", "y=2"]


def test_slurm_render_takes_overrides_after_the_options_end_to_end(tmp_path):
    proc = hvdtrain("slurm", "render", str(CONFIG), "--nodes", "1", "--tasks-per-node", "2",
                    f"log.dir={tmp_path / 'x'}", "train.epochs=2")
    assert proc.returncode == 0, proc.stderr
    assert str(tmp_path / "x") in proc.stdout and "train.epochs=2" in proc.stdout


def test_an_argument_that_is_neither_an_option_nor_an_override_is_refused():
    proc = hvdtrain("slurm", "render", str(CONFIG), "--nodes", "1", "stray")
    assert proc.returncode == EXIT_USAGE and "unrecognized arguments: stray" in proc.stderr


def test_the_environment_failure_code_differs_from_the_user_error_and_resubmit_codes():
    from hvdtrain.signals import EXIT_RESUBMIT

    assert len({EXIT_USAGE, EXIT_ENVIRONMENT, EXIT_RESUBMIT, 0, 1}) == 5


# Settings that would do nothing in the combination given: one line naming the keys, the setting
# that leaves them unread and what to do (hvdtrain.config's check_*_unread, check_pipeline_section;
# comm and optim: tests/unit/test_compression_rules.py and the cases above).
UNREAD = [
    (["ps.servers=2", "ps.chunk_kib=8"],
     "ps.servers=2 and ps.chunk_kib=8 do nothing with comm.topology='ring': only parameter servers "
     "read the ps section; set comm.topology=ps or leave them at their defaults (ps.servers=1, "
     "ps.chunk_kib=4096)"),
    (["ps.overlap=false"],
     "ps.overlap=false does nothing with comm.topology='ring': only parameter servers read the ps "
     "section; set comm.topology=ps or leave ps.overlap at its default true"),
    (["comm.topology=ps", "ps.placement=colocated", "ps.servers=2"],
     "ps.placement='colocated' is gone: the sharded update is sharded data parallel now; set "
     "shard.stage=1 (with comm.topology=ring, docs/sharding.md)"),
    (["shard.chunk_kib=8"],
     "shard.chunk_kib=8 does nothing with shard.stage=0: only the sharded update reads it; set "
     "shard.stage=1 or leave shard.chunk_kib at its default 4096"),
    (["shard.stage=1", "shard.piece_kib=128"],
     "shard.piece_kib=128 does nothing with shard.stage=1: only the units of stages 2 and 3 "
     "travel in pieces (stage 1's rounds: shard.chunk_kib); set shard.stage=2 or 3 or leave "
     "shard.piece_kib at its default 0"),
    (["comm.topology=ps", "ps.overlap=false", "ps.consistency=asp"],
     "ps.overlap=false does nothing with ps.consistency='asp': ps.overlap is read by dedicated "
     "servers under bsp with PyTorch and comm.compression none or fp16 only; leave ps.overlap at "
     "its default true"),
    (["comm.topology=ps", "ps.overlap=false", "framework=tensorflow"],
     "ps.overlap=false does nothing with framework='tensorflow': ps.overlap is read by dedicated "
     "servers under bsp with PyTorch and comm.compression none or fp16 only; leave ps.overlap at "
     "its default true"),
    (["comm.topology=ps", "ps.overlap=false", "comm.compression=qsgd"],
     "ps.overlap=false does nothing with comm.compression='qsgd': ps.overlap is read by dedicated "
     "servers under bsp with PyTorch and comm.compression none or fp16 only; leave ps.overlap at "
     "its default true"),
    (["elastic.commit_every=5"],
     "elastic.commit_every=5 does nothing with elastic.enabled=false: only elastic mode commits, "
     "resizes and records indices; set elastic.enabled=true or leave elastic.commit_every at its "
     "default 10"),
    (["elastic.on_resize=keep_global_batch", "elastic.record_indices=true"],
     "elastic.on_resize='keep_global_batch' and elastic.record_indices=true do nothing with "
     "elastic.enabled=false: only elastic mode commits, resizes and records indices; set "
     "elastic.enabled=true or leave them at their defaults (elastic.on_resize='scale_lr', "
     "elastic.record_indices=false)"),
    (["checkpoint.enabled=false", "checkpoint.every_steps=50", "checkpoint.keep=1"],
     "checkpoint.every_steps=50 and checkpoint.keep=1 do nothing with checkpoint.enabled=false: no "
     "checkpoint is written; set checkpoint.enabled=true or leave them at their defaults "
     "(checkpoint.every_steps=0, checkpoint.keep=3)"),
    (["log.console=false", "log.progress=lines"],
     "log.progress='lines' does nothing with log.console=false: nothing is printed; set "
     "log.console=true or leave log.progress at its default 'auto'"),
    (["log.console=false", "log.console_every_s=0"],
     "log.console_every_s=0.0 does nothing with log.console=false: nothing is printed; set "
     "log.console=true or leave log.console_every_s at its default 1.0"),
    (["log.jsonl=false", "log.jsonl_every_s=5"],
     "log.jsonl_every_s=5.0 does nothing with log.jsonl=false: metrics.jsonl is not written; set "
     "log.jsonl=true or leave log.jsonl_every_s at its default 1.0"),
    (["log.wandb=disabled", "log.wandb_project=mine"],
     "log.wandb_project='mine' does nothing with log.wandb='disabled': no W&B run is made; set "
     "log.wandb=offline or leave log.wandb_project at its default 'hvdtrain'"),
    (["log.wandb=disabled", "log.tensorboard=false", "log.dashboard_every_s=0"],
     "log.dashboard_every_s=0.0 does nothing with log.tensorboard=false and log.wandb='disabled': "
     "no dashboard takes records; set log.tensorboard=true or leave log.dashboard_every_s at its "
     "default 1.0"),
    (["train.slow_ms=20"],
     "train.slow_ms=20.0 does nothing with train.slow_rank=-1: no rank is slowed; set "
     "train.slow_rank to the rank to slow or leave train.slow_ms at its default 0.0"),
    (["train.slow_rank=1"],
     "train.slow_rank=1 does nothing with train.slow_ms=0.0: the rank would sleep 0 ms a step; set "
     "train.slow_ms or leave train.slow_rank at its default -1"),
    (["pipeline.microbatches=4"],
     "pipeline.microbatches=4 does nothing with pipeline.stages=1: without stages every rank "
     "trains the whole model; set pipeline.stages to 2 or more or leave pipeline.microbatches at "
     "its default 0"),
    (["pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2", "pipeline.split=[2, 4, 6]"],
     "pipeline.schedule='interleaved_1f1b', pipeline.virtual_stages=2 and pipeline.split=[2, 4, 6] "
     "do nothing with pipeline.stages=1: without stages every rank trains the whole model; set "
     "pipeline.stages to 2 or more or leave them at their defaults (pipeline.schedule='1f1b', "
     "pipeline.virtual_stages=1, pipeline.split='auto')"),
    (["data.workers=0", "data.prefetch=4"],
     "data.prefetch=4 does nothing with data.workers=0: the batches are gathered on the training "
     "thread, and no loader worker prefetches; set data.workers to 1 or more (-1: half the rank's "
     "cores) or leave data.prefetch at its default 2"),
]


@pytest.mark.parametrize("overrides, message", UNREAD, ids=[m.split(" ")[0] for _, m in UNREAD])
def test_a_setting_that_would_do_nothing_is_one_line_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides, environ={})
    assert str(info.value) == message


@pytest.mark.parametrize("overrides", [
    # Each key of UNREAD where it is read, and its default spelt out where it is not.
    ["comm.topology=ps", "ps.servers=2", "ps.chunk_kib=8", "ps.overlap=false", "ps.timeout_s=60"],
    ["comm.topology=ps", "ps.overlap=false", "comm.compression=fp16"],
    ["shard.stage=1", "shard.chunk_kib=8", "ps.servers=1"],
    ["comm.topology=ps", "ps.consistency=ssp", "ps.staleness=2", "ps.overlap=true"],
    ["ps.servers=1", "ps.placement=dedicated", "ps.overlap=true"],
    ["elastic.enabled=true", "elastic.commit_every=5", "elastic.on_resize=keep_global_batch",
     "elastic.record_indices=true"],
    ["checkpoint.enabled=false", "checkpoint.every_steps=0", "checkpoint.keep=3",
     "checkpoint.resume=auto"],  # a resume reads a checkpoint whether or not the run writes any
    ["log.console=false", "log.jsonl=false", "log.wandb=disabled", "log.tensorboard=false",
     "log.every_steps=5", "log.straggler_steps=2", "log.system=false", "log.console_every_s=1"],
    ["log.wandb=disabled", "log.dashboard_every_s=0"],  # TensorBoard still takes records
    ["log.tensorboard=false", "log.wandb_project=mine", "log.dashboard_every_s=0"],
    ["train.slow_rank=1", "train.slow_ms=20"],
    ["pipeline.stages=2", "pipeline.microbatches=4", "pipeline.schedule=gpipe"],
    ["pipeline.stages=1", "pipeline.microbatches=0", "pipeline.schedule=1f1b"],
    ["data.workers=2", "data.prefetch=4"],
    ["data.workers=0", "data.prefetch=2"],
])
def test_the_same_keys_load_where_they_are_read(overrides):
    load_config(None, overrides, environ={})


SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))


def module_constants(path: Path) -> dict[str, typing.Any]:
    """The top-level assignments of a test module that need none of its imports (its override
    strings), evaluated without importing it: the multirank modules import torch, which the unit
    tests must not load."""
    namespace: dict[str, typing.Any] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            with contextlib.suppress(Exception):  # one that needs an import: not an override set
                exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    return namespace


def test_every_shipped_config_loads_alone_under_slurm_and_with_the_tests_overrides():
    """The configs, the Slurm templates' renders of them (which validate the job's own overrides:
    ``--elastic`` adds ``elastic.enabled=true``) and the override sets of the pipeline equality
    tests, which train the same keys with and without stages."""
    from hvdtrain.slurm import JobOptions, render

    assert len(SHIPPED) == 7  # hf_torch.yaml: docs/huggingface.md
    for path in SHIPPED:
        load_config(path, [], environ={})
        assert "hvdtrain" in render(path, ["elastic.commit_every=5"], JobOptions(elastic=True))
        assert "hvdtrain" in render(path, ["checkpoint.enabled=false", "checkpoint.every_steps=0"])
    multirank = ROOT / "tests" / "multirank"
    pipe, ckpt, optimizers, tf, tf_compression = (
        module_constants(multirank / f"test_pipeline{name}.py")
        for name in ("", "_checkpoint", "_optimizers", "_tf", "_tf_compression"))
    runs = {
        CONFIG: [pipe["WHOLE"], pipe["PER_COPY"],
                 *(f"{pipe['PER_COPY']},{s}" for s in pipe["SCHEDULES"].values()),
                 ckpt["WHOLE"], ckpt["PIPE"], ckpt["FOUR"],
                 *(f"{optimizers['COMMON']},{extra}{stages}"
                   for extra in optimizers["OPTIMIZERS"].values()
                   for stages in ("", "," + optimizers["STAGES"]))],
        TF_CONFIG: [ckpt["TF_COMMON"], ckpt["TF_PIPE"], tf["COMMON"].format(b=16),
                    *tf["NP4"].values(), tf_compression["RANDOMK"], tf_compression["TOPK"]],
    }
    for config, sets in runs.items():
        for overrides in sets:  # as tests/multirank/worker.py splits them
            load_config(config, [o for o in overrides.split(",") if o], environ={})


@pytest.mark.parametrize("override, message", [(o[-1], m) for o, m in UNREAD if len(o) == 1])
def test_train_and_plan_refuse_a_setting_that_would_do_nothing_with_the_same_line(override,
                                                                                  message, tmp_path):
    cluster = ROOT / "hvdtrain" / "plan" / "published" / "horovod_paper.yaml"
    for args in (["train", str(CONFIG)], ["plan", str(CONFIG), "--cluster", str(cluster)]):
        proc = hvdtrain(*args, f"log.dir={tmp_path / 'run'}", override)
        assert proc.returncode == EXIT_USAGE, proc.stderr
        assert proc.stderr.strip() == f"hvdtrain: error: {message}", proc.stderr
