"""Registry, schedule, checkpoint I/O, metrics and the framework-free import rule."""

import json
import subprocess
import sys
import time

import pytest

from hvdtrain.checkpoint import CheckpointManager, atomic_write
from hvdtrain.config import CheckpointConfig, OptimConfig
from hvdtrain.errors import HvdtrainError
from hvdtrain.observe.records import MetricsLogger
from hvdtrain.observe.sinks import JsonlSink
from hvdtrain.registry import DATASETS, MODELS, Registry, import_object
from hvdtrain.schedule import lr_at, peak_lr
from tests.unit.conftest import FRAMEWORKS


def test_import_hvdtrain_loads_no_framework():
    code = ("import sys, hvdtrain, hvdtrain.cli, hvdtrain.config, hvdtrain.loop, hvdtrain.driver, "
            "hvdtrain.elastic, hvdtrain.data.contracts, hvdtrain.data.sampler, hvdtrain.registry, "
            "hvdtrain.doctor, hvdtrain.adapters, hvdtrain.step, hvdtrain.exchange, hvdtrain.controls, "
            "hvdtrain.observe.report, hvdtrain.observe.sinks, hvdtrain.observe.writer\n"
            f"bad = [m for m in {FRAMEWORKS!r} if m in sys.modules]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registry_rejects_duplicates_and_lists_known_names():
    reg = Registry("widget", {"a": 1})
    with pytest.raises(HvdtrainError, match="widget 'a' is already registered"):
        reg.register("a", 2)
    with pytest.raises(HvdtrainError, match="unknown widget 'b'; known: a"):
        reg.get("b")

    @reg.register("c")
    def make_c():
        return 3

    assert reg.get("c") is make_c and list(reg) == ["a", "c"]


def test_import_paths_resolve_and_fail_clearly():
    assert DATASETS.get("hvdtrain.data.digits:DigitsDataset").__name__ == "DigitsDataset"
    assert import_object("hvdtrain.config:Config.to_dict").__name__ == "to_dict"
    with pytest.raises(HvdtrainError, match=r"cannot import 'no_such_pkg.mod'"):
        DATASETS.get("no_such_pkg.mod:X")
    with pytest.raises(HvdtrainError, match="has no attribute 'Nope'"):
        DATASETS.get("hvdtrain.data.digits:Nope")
    with pytest.raises(HvdtrainError,
                       match="unknown torch model 'resnet'; known: gpt, hf_causal_lm, mlp, resnet18"):
        MODELS["torch"].check("resnet")


def test_lr_scaling_warmup_and_cosine():
    cfg = OptimConfig(lr=0.1, warmup_steps=4, schedule="cosine")
    assert peak_lr(cfg, 4) == pytest.approx(0.4)
    assert peak_lr(OptimConfig(lr=0.1, scale_lr=False), 4) == pytest.approx(0.1)
    warm = [lr_at(s, 104, cfg, 4) for s in range(4)]
    assert warm == pytest.approx([0.175, 0.25, 0.325, 0.4])
    assert lr_at(4, 104, cfg, 4) == pytest.approx(0.4)
    assert lr_at(54, 104, cfg, 4) == pytest.approx(0.2)
    assert lr_at(103, 104, cfg, 4) < 0.001


def test_atomic_write_leaves_no_partial_file(tmp_path):
    target = tmp_path / "a.bin"
    atomic_write(target, lambda f: f.write(b"old"))

    def crash(f):
        f.write(b"partial")
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError):
        atomic_write(target, crash)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]


class _FakeWriter:
    """Stands in for the engine's serialiser only: the manager's own logic is what is tested."""

    def __init__(self):
        self.collectives = self  # one process: a collective returns what it was given

    def broadcast_object(self, obj, root_rank=0):
        return obj

    def allreduce_sums(self, sums):
        return sums  # one process: the sum is its own

    def gather_state(self):
        pass  # one process: nothing to collect from other ranks

    def state_bytes(self, meta):
        return json.dumps(meta).encode()


def test_checkpoint_policy_keeps_the_newest(tmp_path):
    mgr = CheckpointManager(CheckpointConfig(every_steps=5, keep=2), tmp_path)
    assert [s for s in range(1, 21) if mgr.due(s)] == [5, 10, 15, 20]
    for step in (5, 10, 15):
        mgr.save(_FakeWriter(), 0, step, {"epoch": 0})
    mgr.wait()  # saves are written behind training
    assert [p.name for p in mgr.checkpoints()] == ["step-00000010.ckpt", "step-00000015.ckpt"]
    assert json.loads(mgr.checkpoints()[-1].read_text()) == {"epoch": 0, "step": 15}
    other_rank = CheckpointManager(CheckpointConfig(every_steps=5), tmp_path / "r")
    assert other_rank.save(_FakeWriter(), 1, 5, {}) is None and not (tmp_path / "r").exists()


def test_jsonl_sink_writes_one_object_per_record(tmp_path):
    logger = MetricsLogger([JsonlSink(tmp_path / "m.jsonl")])
    logger.log({"step": 1, "loss": 0.5, "accuracy": 0.25})
    logger.log({"step": 2, "loss": float("nan")})
    logger.close()
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 0.5, "accuracy": 0.25}, {"step": 2, "loss": None}]
    assert list(lines[0]) == ["step", "loss", "accuracy"]  # the record's own order, step first


def test_jsonl_sink_holds_records_until_due_flushed_or_closed_and_forgets_them_at_a_restart(tmp_path):
    path = tmp_path / "m.jsonl"
    sink = JsonlSink(path, every_s=3600)
    for step in (10, 20, 30):
        sink.log({"step": step})
    assert path.read_text() == ""  # held: not yet due
    sink.flush()  # before a checkpoint or commit, at a stall
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [10, 20, 30]
    for step in (40, 50, 60):
        sink.log({"step": step})
    sink.restart(50, 90)  # an elastic reset to the commit at step 50: step 60 is trained again
    sink.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [10, 20, 30, 40, 50]
    eager = JsonlSink(tmp_path / "e.jsonl", every_s=0)
    eager.log({"step": 1})
    assert (tmp_path / "e.jsonl").read_text() == '{"step": 1}\n'  # written as it comes
    eager.close()


def test_cycle_time_follows_config_then_environment_then_horovods_own():
    from hvdtrain.horovod_start import TCP_FLAGS, set_cycle_time

    env: dict[str, str] = {}
    assert set_cycle_time(0.0, env) == "1"  # Horovod's own, left to Horovod
    assert env == {"OMPI_MCA_mpi_yield_when_idle": "1", "OMPI_MCA_btl_tcp_flags": TCP_FLAGS}
    assert "put" not in TCP_FLAGS.split(",")
    env = {"OMPI_MCA_btl_tcp_flags": "send,put"}  # the user's setting stands
    set_cycle_time(0.0, env)
    assert env["OMPI_MCA_btl_tcp_flags"] == "send,put"
    env = {"HOROVOD_CYCLE_TIME": "2.5"}  # e.g. horovodrun --cycle-time-ms 2.5
    assert set_cycle_time(0.0, env) == "2.5"
    assert set_cycle_time(0.5, env) == "0.5" and env["HOROVOD_CYCLE_TIME"] == "0.5"


def test_compute_threads_divides_the_host_and_respects_a_rank_pinned_to_one_core():
    # In a child process: pinning this one would slow every later test.
    code = ("import os\n"
            "from hvdtrain.horovod_start import compute_threads\n"
            "cores = os.cpu_count()\n"
            "assert compute_threads(3, 2) == 3  # configured wins\n"
            "assert compute_threads(0, 1) == cores\n"
            "assert compute_threads(0, cores * 4) == 1  # never below one\n"
            "os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
            "assert compute_threads(0, 1) == 1, compute_threads(0, 1)  # pinned: one core")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_late_usr1_after_the_run_does_not_kill_the_exiting_process():
    import os
    import signal

    from hvdtrain.signals import StopRequest

    before = signal.getsignal(signal.SIGUSR1)
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
            assert stop()
        os.kill(os.getpid(), signal.SIGUSR1)  # the default action would end pytest here
        time.sleep(0.05)
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
        # A rank that learnt of the stop from another rank has seen no signal of its own.
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        with StopRequest() as stop:
            assert not stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        # A handler of the embedding program's own is given back as it was.
        seen = []
        signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
        with StopRequest():
            pass
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_console_counts_to_the_new_total_after_a_restart():
    import io

    from hvdtrain.observe.sinks import ConsoleSink

    out = io.StringIO()
    console = ConsoleSink(690, out)
    console.log({"step": 480, "epoch": 16, "loss": 0.5})
    console.restart(480, 960)  # an elastic reset at step 480 to one rank: more, smaller steps
    console.log({"step": 700, "epoch": 17, "loss": 0.4})
    assert [line.split()[4] for line in out.getvalue().splitlines()] == ["480/690", "700/960"]
