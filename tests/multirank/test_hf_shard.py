"""The Hugging Face adapter with sharded data parallel and with pipeline stages, at two ranks
(Gloo). A tiny GPT-2 that the test pretrains and writes with ``save_pretrained`` (its head tied
to its token embedding) is fine-tuned for 4 steps of Adam:

- by the ring and by ``shard.stage`` 2 and 3 (3 with ``model.activation_checkpointing``) on the
  same global batches: each ends at the ring's parameters, and stage 3's checkpoint exports
  the tied weight once, the head as its alias;
- with ``model.options.untie_embeddings=true`` and SGD, by 2 pipeline stages (one copy of 16
  windows) and by the ring (2 copies of 8, ``optim.scale_lr=false``): the stages end at the
  ring's parameters, the ring's standing for one process (tests/multirank/test_engines.py).

One launch of ``tests/multirank/worker.py`` runs them one after the other (the pipeline first:
it starts Horovod with process sets). Stage 3's safetensors export and the stages' ``hf`` export
give the ring's logits. Marked ``long``: stages 1 and 3 without activation checkpointing, and a
Llama-architecture model from a config in 2 stages against the ring.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, horovodrun, hvdtrain_cli
from tests.multirank.conftest import PYTHON, WORKER
from tests.text_data import docs_corpus

pytest.importorskip("transformers")
from tests.multirank.test_hf import pretrain

COMMON = ("train.max_steps=4,optim.warmup_steps=0,checkpoint.every_steps=0,log.console=false,"
          "data.batch_size=8")
UNITS = "shard.unit_kib=256"
"""Units of at most 256 KiB: the position embedding, each block (about 200 KiB), the final
LayerNorm; the tied token embedding and head are in no unit (gathered for the whole pass)."""
UNTIED = "model.options.untie_embeddings=true,optim.scale_lr=false,optim.name=sgd,optim.lr=0.05"
"""SGD with momentum for pipeline stages: Adam would scale the float noise of gradients that are
zero in exact arithmetic (GPT-2's key biases: softmax ignores them) up to whole steps."""
TOLERANCE = 1e-5
"""Shard stages: here one micro-batch a step, averaged as the ring does (seen on 2026-12-06:
equal to the bit). Pipeline stages sum the micro-batches' gradients in another order."""
RUNS = {"pipe": f"{UNTIED},data.batch_size=16,pipeline.stages=2", "ring_untied": UNTIED,
        "ring": "", "s2": f"shard.stage=2,{UNITS}",
        "s3_recompute": f"shard.stage=3,{UNITS},model.activation_checkpointing=true,"
                        "checkpoint.every_steps=4"}
LONG_RUNS = {"s1": "shard.stage=1", "s3": f"shard.stage=3,{UNITS}"}
LLAMA = "model.options.architecture=llama," + UNTIED
"""A Llama from a config (its own head already: tie_word_embeddings is false for Llama)."""


def launch(base: Path, corpus: Path, runs: dict[str, str], pretrained: bool = True) -> Path:
    common = f"data.options.root={corpus},{COMMON}"
    if pretrained:
        common += f",model.options.pretrained={base / 'pretrained'}"
    specs = [f"{name}:{common}{',' if extra else ''}{extra}" for name, extra in runs.items()]
    proc = horovodrun(2, "gloo", [PYTHON, WORKER, str(base / "out"),
                                  str(ROOT / "configs" / "hf_torch.yaml"), *specs], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return base


@pytest.fixture(scope="module")
def corpus_and_base(tmp_path_factory) -> tuple[Path, Path]:
    corpus = docs_corpus(tmp_path_factory.mktemp("text") / "docs")
    base = tmp_path_factory.mktemp("hf-shard")
    pretrain(corpus, base / "pretrained", steps=30)
    return corpus, base


@pytest.fixture(scope="module")
def launched(corpus_and_base) -> Path:
    corpus, base = corpus_and_base
    return launch(base, corpus, RUNS)


@pytest.fixture(scope="module")
def launched_long(corpus_and_base, tmp_path_factory) -> Path:
    corpus, base = corpus_and_base
    long = tmp_path_factory.mktemp("hf-shard-long")
    (long / "pretrained").symlink_to(base / "pretrained")
    launch(long, corpus, LONG_RUNS | {"ring": ""})
    llama = tmp_path_factory.mktemp("hf-llama-pipe")
    return launch(llama, corpus, {"pipe": f"{LLAMA},data.batch_size=16,pipeline.stages=2",
                                  "ring": LLAMA}, pretrained=False), long


def parameters(base: Path, run: str, rank: int) -> dict[str, np.ndarray]:
    with np.load(base / "out" / run / f"rank{rank}.npz") as npz:
        return dict(npz)


def assert_at_ring(base: Path, run: str, ring: str = "ring") -> None:
    want = parameters(base, ring, 0)
    for rank in (0, 1):
        got = parameters(base, run, rank)
        assert got.keys() == want.keys() and len(got) > 20, run
        for key in want:
            np.testing.assert_allclose(got[key], want[key], atol=TOLERANCE, rtol=0,
                                       err_msg=f"{run} rank {rank} {key}")


def assert_stages_at_ring(base: Path, ring: str) -> None:
    """The two stages' parameters, in layer order (``"<layer>.<name>"``), are the ring's in
    the model's order (embedding, blocks, final norm and head)."""
    want = parameters(base, ring, 0)
    stages = parameters(base, "pipe", 0)
    stages.update(parameters(base, "pipe", 1))
    assert parameters(base, "pipe", 0).keys().isdisjoint(parameters(base, "pipe", 1))
    ordered = sorted(stages, key=lambda key: int(key.split(".")[0]))
    assert len(ordered) == len(want) and "lm_head.weight" in want
    for key, hf_key in zip(ordered, want, strict=True):
        np.testing.assert_allclose(stages[key], want[hf_key], atol=TOLERANCE, rtol=0,
                                   err_msg=f"{key} against {hf_key}")


@pytest.mark.parametrize("run", ["s2", "s3_recompute"])
def test_each_stage_fine_tunes_to_the_rings_parameters(launched, run):
    assert_at_ring(launched, run)


def test_the_ring_moved_from_the_pretrained_weights(launched):
    """The comparisons mean something: 4 steps moved the weights far beyond the tolerance."""
    from safetensors.numpy import load_file

    pretrained = load_file(str(launched / "pretrained" / "model.safetensors"))
    ring = parameters(launched, "ring", 0)
    moved = min(float(np.abs(ring[k] - pretrained[k]).max()) for k in ring)
    assert moved > 100 * TOLERANCE, moved


def logits_of(config, state: dict[str, np.ndarray], batch):
    """The logits on ``batch`` of a transformers model of ``config`` holding ``state``."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = model.load_state_dict(
        {key: torch.from_numpy(np.asarray(value)) for key, value in state.items()}, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}  # tied: the embedding's
    with torch.no_grad():
        return model(input_ids=batch).logits


def test_stage_3_exports_the_tied_weight_once_with_its_alias(launched, corpus_and_base):
    """Stage 3's checkpoint (each rank's shards, streamed a tensor at a time) exports as a ring
    run's: the tied weight once, the head named as its alias, at the ring's values; loaded into
    the transformers model, the ring's logits."""
    import torch
    import transformers
    from safetensors import safe_open
    from safetensors.torch import load_file

    from tests.multirank.test_hf import windows

    run = launched / "out" / "s3_recompute"
    proc = hvdtrain_cli("export", str(run), "--format", "safetensors", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ring = parameters(launched, "ring", 0)
    with safe_open(str(run / "export-safetensors" / "model.safetensors"), "np") as f:
        assert json.loads(f.metadata()["aliases"]) == {"lm_head.weight": "transformer.wte.weight"}
        assert set(f.keys()) == set(ring)
        for key in ring:
            np.testing.assert_allclose(f.get_tensor(key), ring[key], atol=TOLERANCE, rtol=0,
                                       err_msg=key)
    config = transformers.AutoConfig.from_pretrained(str(launched / "pretrained"))
    batch = windows(corpus_and_base[0], 4, 99)[:, :-1]
    exported = load_file(str(run / "export-safetensors" / "model.safetensors"))
    torch.testing.assert_close(logits_of(config, exported, batch),
                               logits_of(config, ring, batch), rtol=0, atol=1e-4)


def test_two_pipeline_stages_fine_tune_to_the_rings_parameters(launched):
    from safetensors.numpy import load_file

    assert_stages_at_ring(launched, "ring_untied")
    pretrained = load_file(str(launched / "pretrained" / "model.safetensors"))
    ring = parameters(launched, "ring_untied", 0)
    assert max(float(np.abs(ring[k] - pretrained[k]).max()) for k in pretrained) > 1e-3


def test_pipeline_stages_export_to_transformers_under_its_names(launched, corpus_and_base):
    """The stages' checkpoint names the layer list (``0.wte.weight``, ...); ``export --format
    hf`` renames it to the model's keys: ``from_pretrained`` loads the fine-tuned weights, the
    head its own (untied), and gives the ring's logits."""
    import torch
    import transformers

    from tests.multirank.test_hf import windows

    run = launched / "out" / "pipe"
    proc = hvdtrain_cli("export", str(run), "--format", "hf", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(run / "export-hf"),
                                                              local_files_only=True)
    assert model.lm_head.weight is not model.transformer.wte.weight
    state = model.state_dict()
    for key, value in parameters(launched, "ring_untied", 0).items():
        np.testing.assert_allclose(state[key].numpy(), value, atol=TOLERANCE, rtol=0,
                                   err_msg=key)
    batch = windows(corpus_and_base[0], 4, 99)[:, :-1]
    with torch.no_grad():
        got = model.eval()(input_ids=batch).logits
    torch.testing.assert_close(got, logits_of(model.config, parameters(launched, "ring_untied", 0),
                                              batch), rtol=0, atol=1e-4)


@pytest.mark.long
def test_stages_1_and_3_and_a_llama_in_pipeline_stages(launched_long):
    llama, long = launched_long
    assert_at_ring(long, "s1")
    assert_at_ring(long, "s3")
    assert_stages_at_ring(llama, "ring")
