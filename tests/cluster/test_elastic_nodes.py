"""Elastic training across the two namespace nodes: node2 is lost mid-run (its link cut, its ranks
gone), the survivor notices within the Gloo timeout the user set and trains on alone; the link is
mended, node2 comes back after its blacklist cool-down and rejoins."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np

from tests.cluster.conftest import (
    NODES,
    ROOT,
    TRAIN_SAMPLES,
    check_on_two_nodes,
    cluster_script,
    summary,
    train_argv,
)
from tests.conftest import BIN, read_jsonl

COMMIT_EVERY = 10
EPOCHS = 25
GLOO_TIMEOUT_S = 10


def elastic_job(env: dict[str, str], run: Path, hosts: Path) -> subprocess.Popen:
    """1 to 2 workers on the hosts listed in ``hosts``, paced so that the test can act mid-run."""
    cmd = [str(BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", str(ROOT / "scripts" / "discover_hosts_file.sh"),
           "--network-interfaces", "br-hvd", "--gloo-timeout-seconds", str(GLOO_TIMEOUT_S),
           "--blacklist-cooldown-range", "5", "10",
           *train_argv(run, "elastic.enabled=true", f"elastic.commit_every={COMMIT_EVERY}",
                       "elastic.record_indices=true", f"train.epochs={EPOCHS}", "log.every_steps=5",
                       "log.console=true", "log.progress=lines", "optim.schedule=constant",
                       "optim.warmup_steps=0", "model.name=tests.multirank.elastic_models:PacedMLP",
                       "model.options={hidden: [128], pause: 0.05}")]
    run.parent.mkdir(parents=True, exist_ok=True)
    with (run.parent / "job.log").open("w") as log:  # a file: a full pipe would block the job
        return subprocess.Popen(cmd, env={**env, "HVDTRAIN_HOSTS_FILE": str(hosts)}, cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, text=True)


def wait_until(ready, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def resets_to(run: Path, world_size: int) -> list[dict]:
    path = run / "elastic.jsonl"
    events = read_jsonl(path)[1:] if path.exists() else []
    return [e for e in events if e["event"] == "reset" and e["world_size"] == world_size]


def lose_node2() -> float:
    """Cuts node2's link, then kills its ranks (a node that died); returns when."""
    cluster_script("link", "2", "down")
    pids = subprocess.run(["ip", "netns", "pids", "node2"], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b"bin/hvdtrain") for arg in cmdline):
            subprocess.run(["kill", f"-{signal.SIGKILL.value}", pid], check=False)
    return time.time()


def test_node_lost_then_rejoins(cluster, tmp_path):
    run, hosts = tmp_path / "run", tmp_path / "hosts.txt"
    hosts.write_text("node1:1\nnode2:1\n")
    metrics = run / "metrics.jsonl"
    proc = elastic_job(cluster, run, hosts)
    try:
        wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3,
                   "three metrics records", timeout=240)
        lost_at = lose_node2()
        wait_until(lambda: resets_to(run, 1), "the reset to 1 worker", timeout=120)
        cluster_script("link", "2", "up")
        wait_until(lambda: resets_to(run, 2), "node2 rejoining", timeout=180)
        proc.wait(timeout=400)
    finally:
        proc.kill()
        cluster_script("link", "2", "up")
    log = (tmp_path / "job.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    shrink, rejoin = resets_to(run, 1)[0], resets_to(run, 2)[0]
    # noticed within the Gloo timeout set above (plus the reset itself), not Gloo's default 30 s
    assert shrink["time"] - lost_at < GLOO_TIMEOUT_S + 15, (shrink, lost_at)
    assert 0 <= shrink["lost_steps"] <= COMMIT_EVERY
    assert rejoin["lost_steps"] == 0 and rejoin["step"] > shrink["step"]
    result = summary(run)
    assert result["elastic"]["resets"] == 2 and result["world_size"] == 2
    check_on_two_nodes(result)
    assert result["samples"] == EPOCHS * TRAIN_SAMPLES
    paths = sorted((run / "indices").glob("epoch-*.npy"))
    assert len(paths) == EPOCHS
    for path in paths:  # every sample once per epoch
        assert np.array_equal(np.sort(np.load(path)), np.arange(TRAIN_SAMPLES)), path.name
    steps = [r["step"] for r in read_jsonl(metrics)]
    assert steps == sorted(set(steps))
    assert json.loads((run / "summary.json").read_text())["hosts"] == NODES
    # the console's step count should follow the resizes: never past the total it shows (rank 0
    # prints it; horovodrun's label of the surviving process may change with the reset)
    counts = re.findall(r"\[\d+\]<stdout>:\[hvdtrain\] epoch \d+ step +(\d+)/(\d+)", log)
    assert len(counts) > 10, log[-4000:]
    past = [(step, total) for step, total in counts if int(step) > int(total)]
    assert not past, f"console step count past its total after a resize: {past[:3]}"
