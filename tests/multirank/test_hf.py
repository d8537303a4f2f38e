"""Hugging Face at two ranks (Gloo): a tiny GPT-2 that the test pretrains and writes with
``save_pretrained`` is fine-tuned by ``model.name=hf_causal_lm`` with compressed gradients; the
run starts at the pretrained model's loss, not a random one's, and its checkpoint exports to
safetensors and to a directory that ``AutoModelForCausalLM.from_pretrained`` loads, with the
trained model's logits."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.conftest import ROOT, horovodrun, hvdtrain_cli, read_jsonl
from tests.text_data import docs_corpus

transformers = pytest.importorskip("transformers")

SEQ = 64
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": SEQ, "vocab_size": 256,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": None,
        "eos_token_id": None}


def windows(corpus: Path, count: int, seed: int) -> torch.Tensor:
    """``count`` random windows of SEQ + 1 tokens of the corpus's training split."""
    tokens = np.fromfile(corpus / "train.bin", np.uint8)
    starts = np.random.default_rng(seed).integers(0, len(tokens) - SEQ - 1, count)
    return torch.from_numpy(np.stack([tokens[s:s + SEQ + 1] for s in starts]).astype(np.int64))


def mean_loss(model: torch.nn.Module, batch: torch.Tensor) -> float:
    """The mean next-token cross-entropy of ``model`` on ``batch`` (windows of SEQ + 1)."""
    with torch.no_grad():
        logits = model(input_ids=batch[:, :-1]).logits
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       batch[:, 1:].reshape(-1)))


def pretrain(corpus: Path, out: Path, steps: int = 120) -> float:
    """Trains a tiny GPT-2 on the corpus, writes it with save_pretrained to ``out`` and returns
    its loss on held-out random windows."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(steps):
        batch = windows(corpus, 16, step)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)
    return mean_loss(model.eval(), windows(corpus, 64, 10_000))


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    corpus = docs_corpus(tmp_path_factory.mktemp("text") / "docs")
    base = tmp_path_factory.mktemp("hf")
    pretrained_loss = pretrain(corpus, base / "pretrained")
    run = base / "run"
    proc = horovodrun(2, "gloo", [
        str(ROOT / ".venv" / "bin" / "hvdtrain"), "train", str(ROOT / "configs" / "hf_torch.yaml"),
        f"model.options.pretrained={base / 'pretrained'}", f"data.options.root={corpus}",
        f"log.dir={run}", "log.console=false", "log.wandb=disabled", "log.every_steps=1",
        "train.max_steps=12", "optim.lr=0.0003", "optim.warmup_steps=0",
        "comm.compression=fp16", "checkpoint.every_steps=12"], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return corpus, base, run, pretrained_loss


def test_two_ranks_finetune_a_pretrained_model_from_its_loss(finetuned):
    """The first step's loss is the pretrained model's (within the sampling noise of one batch of
    32 windows), far below the ln 256 = 5.55 of a random model; training goes on from there."""
    corpus, _, run, pretrained_loss = finetuned
    torch.manual_seed(0)
    fresh = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY)).eval()
    random_loss = mean_loss(fresh, windows(corpus, 64, 10_000))
    assert pretrained_loss < random_loss - 1.5, (pretrained_loss, random_loss)
    records = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r and "step" in r]
    first = records[0]
    print(f"pretrained {pretrained_loss:.3f}, random {random_loss:.3f}, first logged "
          f"{first['loss']:.3f}, step 12 {records[-1]['loss']:.3f}")
    assert first["step"] == 1
    assert abs(first["loss"] - pretrained_loss) < 0.3, (first["loss"], pretrained_loss)
    assert first["perplexity"] == pytest.approx(math.exp(first["loss"]))
    assert 0.0 < first["token_accuracy"] < 1.0
    assert records[-1]["step"] == 12 and records[-1]["loss"] < random_loss - 1.5


def test_the_checkpoint_exports_to_safetensors_and_transformers_with_its_logits(finetuned):
    """Both exports give the logits of the model in the run's last checkpoint (step 12), which
    are not the pretrained model's: the export holds the fine-tuned weights."""
    from safetensors.torch import load_file

    corpus, base, run, _ = finetuned
    [checkpoint] = sorted((run / "checkpoints").glob("step-*.ckpt"))
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert state["meta"]["position"]["step"] == 12
    trained = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY)).eval()
    trained.load_state_dict(state["model"])
    batch = windows(corpus, 4, 99)[:, :-1]
    with torch.no_grad():
        expected = trained(input_ids=batch).logits
        for fmt in ("safetensors", "hf"):
            proc = hvdtrain_cli("export", str(run), "--format", fmt, timeout=600)
            assert proc.returncode == 0 and f"exported to {run / f'export-{fmt}'}" in proc.stdout, \
                proc.stderr[-2000:]
        tensors = load_file(str(run / "export-safetensors" / "model.safetensors"))
        from_file = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY)).eval()
        missing, unexpected = from_file.load_state_dict(tensors, strict=False)
        assert unexpected == [] and missing == ["lm_head.weight"]  # tied to wte, written once
        torch.testing.assert_close(from_file(input_ids=batch).logits, expected, rtol=0, atol=1e-5)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            str(run / "export-hf"), local_files_only=True).eval()
        torch.testing.assert_close(loaded(input_ids=batch).logits, expected, rtol=0, atol=1e-5)
        pretrained = transformers.AutoModelForCausalLM.from_pretrained(
            str(base / "pretrained"), local_files_only=True).eval()
        assert float((pretrained(input_ids=batch).logits - expected).abs().max()) > 1e-3


def test_two_ranks_train_a_llama_on_json_lines_tokenized_once(tmp_path):
    """data.name=hf_dataset at two ranks: the documents are tokenized once into one cached corpus
    (both ranks read it), and a Llama-architecture model from a config trains on it."""
    import json

    docs = [p for f in sorted((ROOT / "docs").glob("*.md"))[:6]
            for p in f.read_text().split("\n\n") if p.strip()]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    config = yaml.safe_load((ROOT / "configs" / "hf_torch.yaml").read_text())
    config["data"]["name"] = "hf_dataset"
    config["data"]["options"] = {"path": str(tmp_path / "docs.jsonl"), "text_column": "text",
                                 "vocab_size": 512, "seq_len": 64,
                                 "cache_dir": str(tmp_path / "cache")}
    (tmp_path / "hf.yaml").write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    proc = horovodrun(2, "gloo", [
        str(ROOT / ".venv" / "bin" / "hvdtrain"), "train", str(tmp_path / "hf.yaml"),
        "model.options.architecture=llama",
        f"log.dir={run}", "log.console=false", "log.wandb=disabled", "train.max_steps=30",
        "checkpoint.every_steps=0"], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [corpus] = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    meta = json.loads((corpus / "meta.json").read_text())
    assert meta["vocab_size"] == 512 and meta["tokenizer_file"] == "tokenizer.json"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 30
    # From ln 512 = 6.24 for a uniform guess; 30 steps of Adam get well below it.
    assert summary["final"]["eval_loss"] < 5.5, summary["final"]
