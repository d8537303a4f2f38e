"""The Hugging Face adapter with sharded data parallel, at two ranks (Gloo): a tiny GPT-2 that
the test pretrains and writes with ``save_pretrained`` (its head tied to its token embedding) is
fine-tuned by the ring and by ``shard.stage`` 1, 2 and 3 (3 also with
``model.activation_checkpointing``) on the same global batches, and each ends at the ring's
parameters; stage 3's checkpoint holds the tied weight under both of its names.

One launch of ``tests/multirank/worker.py`` runs them all, one after the other.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, horovodrun
from tests.multirank.conftest import PYTHON, WORKER
from tests.text_data import docs_corpus

pytest.importorskip("transformers")
from tests.multirank.test_hf import pretrain

COMMON = ("train.max_steps=4,optim.warmup_steps=0,data.batch_size=8,checkpoint.every_steps=0,"
          "log.console=false,log.every_steps=1")
UNITS = "shard.unit_kib=256"
"""Units of at most 256 KiB: the position embedding, each block (about 200 KiB), the final
LayerNorm; the tied token embedding and head are in no unit (gathered for the whole pass)."""
TOLERANCE = 1e-5
"""The shards average each micro-batch's gradient as the ring does here (one micro-batch a
step); seen: equal to the bit after 4 steps of Adam on 2026-12-06."""
RUNS = {"ring": "", "s1": "shard.stage=1", "s2": f"shard.stage=2,{UNITS}",
        "s3": f"shard.stage=3,{UNITS},checkpoint.every_steps=4",
        "s3_recompute": f"shard.stage=3,{UNITS},model.activation_checkpointing=true"}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    corpus = docs_corpus(tmp_path_factory.mktemp("text") / "docs")
    base = tmp_path_factory.mktemp("hf-shard")
    pretrain(corpus, base / "pretrained", steps=30)
    common = f"model.options.pretrained={base / 'pretrained'},data.options.root={corpus},{COMMON}"
    runs = [f"{name}:{common}{',' if extra else ''}{extra}" for name, extra in RUNS.items()]
    proc = horovodrun(2, "gloo", [PYTHON, WORKER, str(base / "out"),
                                  str(ROOT / "configs" / "hf_torch.yaml"), *runs], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return base


def parameters(base: Path, run: str, rank: int) -> dict[str, np.ndarray]:
    with np.load(base / "out" / run / f"rank{rank}.npz") as npz:
        return dict(npz)


@pytest.mark.parametrize("run", ["s1", "s2", "s3", "s3_recompute"])
def test_each_stage_fine_tunes_to_the_rings_parameters(launched, run):
    ring = parameters(launched, "ring", 0)
    for rank in (0, 1):
        got = parameters(launched, run, rank)
        assert got.keys() == ring.keys() and "transformer.wte.weight" in got, run
        for key in ring:
            np.testing.assert_allclose(got[key], ring[key], atol=TOLERANCE, rtol=0,
                                       err_msg=f"{run} rank {rank} {key}")


def test_the_ring_moved_from_the_pretrained_weights(launched):
    """The comparison above means something: 4 steps moved the weights well beyond it."""
    from safetensors.numpy import load_file

    pretrained = load_file(str(launched / "pretrained" / "model.safetensors"))
    ring = parameters(launched, "ring", 0)
    moved = max(float(np.abs(ring[k] - pretrained[k]).max()) for k in ring)
    assert moved > 100 * TOLERANCE, moved


def test_stage_3_checkpoints_the_tied_weight_under_both_names(launched):
    [path] = sorted((launched / "out" / "s3" / "checkpoints").glob("step-*.ckpt"))
    model = torch.load(path, map_location="cpu", weights_only=True)["model"]
    ring = parameters(launched, "ring", 0)
    for key in ("transformer.wte.weight", "lm_head.weight"):
        np.testing.assert_allclose(model[key].numpy(), ring["transformer.wte.weight"],
                                   atol=TOLERANCE, rtol=0, err_msg=key)
