"""kerashub_causal_lm's options and their one-line refusals (framework-free: hvdtrain/kerashub.py)."""

from __future__ import annotations

import pytest

from hvdtrain.errors import HvdtrainError
from hvdtrain.kerashub import KerasHubOptions


@pytest.mark.parametrize("options, message", [
    ({"architecture": "bert"}, "architecture='bert': expected one of gpt2, llama"),
    ({"layers": 2}, "unknown option(s) for kerashub_causal_lm: layers"),
    ({"vocab_size": -1}, "vocab_size=-1"),
    ({"config": [1]}, "config=[1]: expected a mapping"),
    ({"pretrained": "/nonexistent/preset"}, "no such directory"),
    ({"pretrained": ".", "config": {"num_layers": 1}}, "drop config and vocab_size"),
])
def test_bad_options_are_one_line(options, message):
    with pytest.raises(HvdtrainError) as err:
        KerasHubOptions.of(options)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_preset_directory_missing_a_file_is_named(tmp_path):
    with pytest.raises(HvdtrainError, match=r"config\.json is missing"):
        KerasHubOptions.of({"pretrained": str(tmp_path)})
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(HvdtrainError, match=r"model\.weights\.h5 is missing"):
        KerasHubOptions.of({"pretrained": str(tmp_path)})
    (tmp_path / "model.weights.h5").write_bytes(b"")
    assert KerasHubOptions.of({"pretrained": str(tmp_path)}).pretrained == str(tmp_path)


def test_a_new_model_takes_small_sizes_unless_config_sets_them():
    options = KerasHubOptions.of({"config": {"num_layers": 3}})
    assert options.new_config() == {"num_layers": 3, "num_heads": 4, "hidden_dim": 64,
                                    "intermediate_dim": 256, "max_sequence_length": 1024,
                                    "dropout": 0.0}
