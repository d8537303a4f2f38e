"""hf_causal_lm's options and their one-line refusals (framework-free: hvdtrain/hf.py)."""

from __future__ import annotations

import json

import pytest

from hvdtrain.errors import HvdtrainError
from hvdtrain.hf import HfOptions


@pytest.mark.parametrize("options, message", [
    ({"architecture": "bert"}, "architecture='bert': expected one of gpt2, llama, qwen2"),
    ({"layers": 2}, "unknown option(s) for hf_causal_lm: layers"),
    ({"vocab_size": -1}, "vocab_size=-1"),
    ({"pretrained": "/nonexistent/model"}, "no such directory"),
    ({"pretrained": ".", "config": {"n_layer": 1}}, "drop config and vocab_size"),
])
def test_bad_options_are_one_line(options, message):
    with pytest.raises(HvdtrainError) as err:
        HfOptions.of(options)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_pretrained_directory_missing_a_file_is_named(tmp_path):
    with pytest.raises(HvdtrainError, match=r"config\.json is missing"):
        HfOptions.of({"pretrained": str(tmp_path)})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(HvdtrainError, match=r"no weights \(expected one of model\.safetensors"):
        HfOptions.of({"pretrained": str(tmp_path)})
