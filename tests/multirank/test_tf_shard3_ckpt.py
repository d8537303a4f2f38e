"""Checkpoints of TensorFlow's stage 3 (``shard.stage=3``) written without gathering the model:
every rank writes its slices of the parameters and of the optimizer's slots to its own part,
rank 0's file holds empty entries for the trainable variables; every reader assembles at most
one variable whole at a time: stage 3 at another number of ranks, stage 1, the ring, and
``hvdtrain export``; and stage 3 resumes the ring's checkpoint, a variable at a time.

``make test``: one launch at 3 ranks under Gloo (2 micro-batches of 8 samples a rank, global
batch 48, Adam with weight decay, one epoch of 30 steps, a checkpoint every 20 steps): stage 3,
stage 3 resumed from its step-20 checkpoint (bit-identical), and the ring resumed from its last
checkpoint, which holds it exactly, as does the export of that checkpoint; and a second launch
at 3 ranks: the ring and stage 3 resumed from the ring's step-20 checkpoint (SGD with momentum).
``make test-long``: at 2 ranks (12 samples a rank: the same global batch) stage 3, stage 1 and
the ring resumed from stage 3's step-20 checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import keras
import numpy as np
import pytest
from safetensors.numpy import load_file

from hvdtrain.export import export
from hvdtrain.tensorflow.export import FILES
from tests.multirank.conftest import Launch, launch_worker

STAGE3 = "shard.stage=3,shard.unit_kib=16"  # 4,096 elements: each of the 2 layers a group
ADAM = ("optim.name=adam,optim.lr=0.001,optim.weight_decay=0.01,checkpoint.every_steps=20,"
        "train.backward_passes_per_step=2,train.epochs=1,data.batch_size={batch}")
SHAPES = [(64, 128), (128,), (128, 10), (10,)]
PARAMETERS = sum(int(np.prod(s)) for s in SHAPES)
TOLERANCE = 1e-5
"""Stage 3 sums the micro-batches' averages where the ring averages their sum: float rounding
(seen 1e-7 after 45 Adam steps at 2 ranks in test_tf_shard3.py); a slice read from the wrong
place moves the parameters by 1e-3 or more within the 10 steps after the resume. The 3-rank
comparison with the ring uses SGD with momentum (the ring's checkpoint hands out a slot other
than Adam's); Adam there once ended 2e-3 off, most likely Gloo's reduce-scatter (patches/0012):
with it, within 3e-8 in 3 launches."""


def checkpoint(out: Path, name: str, at: int) -> Path:
    return out / name / "checkpoints" / f"step-{at:08d}.ckpt"


@pytest.fixture(scope="session")
def ckpt3(tmp_path_factory) -> Callable[[str], Launch]:
    """``ckpt3(which)``: the ``make test`` launch (``short``), the long one at 3 ranks
    (``ring``) or at 2 ranks (``two``)."""
    cache: dict[str, Launch] = {}

    def get(which: str) -> Launch:
        if which not in cache:
            out = tmp_path_factory.mktemp(f"shard3-ckpt-{which}")
            three = ADAM.format(batch=8)
            if which == "short":
                saved, last = checkpoint(out, "s3", 20), checkpoint(out, "s3", 30)
                runs = [f"s3:{three},{STAGE3}",
                        f"s3_again:{three},{STAGE3},checkpoint.resume={saved}",
                        f"ring_at_end:{three},checkpoint.resume={last}"]
                cache[which] = launch_worker(3, "gloo", "tensorflow", out, runs)
            elif which == "ring":
                saved = checkpoint(out, "ring", 20)
                sgd = three.replace("optim.name=adam", "optim.name=sgd,optim.momentum=0.9")
                runs = [f"ring:{sgd}", f"s3_from_ring:{sgd},{STAGE3},checkpoint.resume={saved}"]
                cache[which] = launch_worker(3, "gloo", "tensorflow", out, runs)
            else:
                saved = checkpoint(get("short").out, "s3", 20)
                two = f"{ADAM.format(batch=12)},checkpoint.resume={saved}"
                runs = [f"s3:{two},{STAGE3}", f"s1:{two},shard.stage=1", f"ring:{two}"]
                cache[which] = launch_worker(2, "gloo", "tensorflow", out, runs)
        return cache[which]

    return get


def params(launch: Launch, run: str, ranks: int) -> list[np.ndarray]:
    """The run's trainable variables in order, the same on every rank."""
    got = [launch.rank(run, r)[0] for r in range(ranks)]
    for other in got[1:]:
        assert other.keys() == got[0].keys() and all(
            np.array_equal(other[k], got[0][k]) for k in other), run
    return [got[0][k] for k in sorted(got[0], key=lambda k: int(k.split(".")[0]))]


def assert_near(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    assert [g.shape for g in got] == [w.shape for w in want] == SHAPES, what
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=TOLERANCE, err_msg=what)


def test_stage3_writes_slices_only_and_every_reader_resumes_them(ckpt3):
    launch = ckpt3("short")
    out = launch.out
    # Rank 0's file: the trainable variables' entries empty, the slots in the parts too.
    with np.load(checkpoint(out, "s3", 20), allow_pickle=False) as npz:
        meta = json.loads(str(npz["meta"]))
        model = [npz[f"model/{i}"].shape for i in range(len(SHAPES))]
        slots = [npz[k].shape for k in npz.files if k.startswith("optimizer/") and npz[k].ndim]
    assert model == [(0,)] * 4 and slots == [(0,), (0,)]
    assert meta["slot_kinds"] == {"s2": "momentum", "s3": "velocity"}
    parts = meta["parts"]
    assert [p["shard"] for p in parts] == [0, 1, 2] and all(p["of"] == 3 for p in parts)
    held = [load_file(checkpoint(out, "s3", 20).parent / p["file"]) for p in parts]
    # Each rank's slices of each of the 4 variables: a third of the parameters each.
    assert sum(t[f"u{u}.params"].size for t in held for u in range(4)) == PARAMETERS
    assert [sum(t[f"u{u}.s2"].size for u in range(4)) for t in held] == [
        sum(t[f"u{u}.params"].size for u in range(4)) for t in held]
    final = params(launch, "s3", 3)
    # Bit-identical when nothing changed; the ring reads each variable whole from the parts.
    again = params(launch, "s3_again", 3)
    assert all(np.array_equal(a, f) for a, f in zip(again, final, strict=True))
    # The ring resumed from the last checkpoint (nothing left to train) holds it exactly.
    ring = params(launch, "ring_at_end", 3)
    assert all(np.array_equal(r, f) for r, f in zip(ring, final, strict=True))
    # The export of the last checkpoint (step 30, every variable in the parts) is the model.
    exported = keras.saving.load_model(export(str(out / "s3"), "keras") / FILES["keras"])
    got = [np.asarray(v) for v in exported.trainable_variables]
    assert all(np.array_equal(g, f) for g, f in zip(got, final, strict=True))


def test_stage3_resumes_the_rings_checkpoint(ckpt3):
    # Also Horovod's fused reduce-scatter under Gloo (the ring started Horovod in this process
    # with its fusion buffer on): before patches/0012, rank 0's slices of the last unit were
    # wrong after the first step in about one launch in two (1e-3 from the ring at the end).
    launch = ckpt3("ring")
    assert_near(params(launch, "s3_from_ring", 3), params(launch, "ring", 3),
                "stage 3 from the ring's step 20")


@pytest.mark.long
def test_two_ranks_resume_stage3_at_stage3_stage1_and_on_the_ring(ckpt3):
    launch = ckpt3("two")
    ring = params(launch, "ring", 2)
    assert_near(params(launch, "s3", 2), ring, "stage 3 at 2 ranks from 3 ranks' step 20")
    assert_near(params(launch, "s1", 2), ring, "stage 1 at 2 ranks from stage 3's step 20")
    summary = json.loads((launch.out / "s3" / "summary.json").read_text())
    assert summary["world_size"] == 2
