"""The tokenizer of a corpus made by ``make-text --tokenizer`` follows the run: the summary names
it, ``export --format hf`` writes it so that ``AutoTokenizer`` loads it (and encodes the text
as the corpus's ids), and ``export --format safetensors`` copies it beside the weights."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hvdtrain.data.hf_text import make_tokenized_text
from hvdtrain.driver import train
from hvdtrain.export import export
from tests.conftest import ROOT, quiet_config

transformers = pytest.importorskip("transformers")

SOURCE = ROOT / "docs" / "data.md"


def test_the_summary_and_both_exports_name_the_corpus_tokenizer(tmp_path):
    corpus = tmp_path / "corpus"
    meta = make_tokenized_text([SOURCE], corpus, 0.1, "bpe", 300)
    cfg = quiet_config(ROOT / "configs" / "hf_torch.yaml", tmp_path, f"data.options.root={corpus}",
                       "data.options.seq_len=32", "data.batch_size=4", "train.max_steps=2",
                       "checkpoint.every_steps=2", "model.options.config={n_embd: 32}")
    result = train(cfg)
    tokenizer = corpus / "tokenizer.json"
    assert result.summary["tokenizer"] == str(tokenizer.resolve())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["tokenizer"] == str(tokenizer.resolve())

    out = export(str(tmp_path / "run"), "hf")
    loaded = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    text = SOURCE.read_text().splitlines(keepends=True)[0]
    ids = np.fromfile(corpus / "train.bin", meta["dtype"])
    encoded = loaded(text, add_special_tokens=False)["input_ids"]
    assert encoded == ids[:len(encoded)].tolist() and len(encoded) > 3
    assert len(loaded) == 300
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert model.config.vocab_size == 300

    out = export(str(tmp_path / "run"), "safetensors")
    assert (out / "tokenizer.json").read_text() == tokenizer.read_text()
    assert (out / "model.safetensors").is_file()
