"""The language model's framework-free parts: options, shape for a dataset, perplexity in the
loop's means."""

from __future__ import annotations

import math

import pytest

from hvdtrain.data.contracts import ArraySpec, DatasetSpec
from hvdtrain.errors import HvdtrainError
from hvdtrain.lm import DERIVED_METRICS, GptOptions, GptShape, gpt_shape, residual_std
from hvdtrain.loop import means

WINDOWS = DatasetSpec(inputs=ArraySpec((64,), "int64"), targets=ArraySpec((64,), "int64"),
                      num_classes=256)


def test_the_shape_comes_from_the_data_unless_the_options_say_more():
    assert gpt_shape(GptOptions(), WINDOWS) == GptShape(vocab_size=256, context=64, seq_len=64)
    assert gpt_shape(GptOptions(context=128, vocab_size=300), WINDOWS) == GptShape(300, 128, 64)
    assert residual_std(2) == pytest.approx(0.01)


@pytest.mark.parametrize("options, message", [
    ({"layers": 0}, r"model.options.layers=0: expected a positive integer"),
    ({"d_model": 30, "heads": 4}, r"heads=4 must divide d_model=30"),
    ({"dropout": 1.0}, r"dropout=1.0: expected a number in \[0, 1\)"),
    ({"context": -1}, r"context=-1: expected a non-negative integer"),
    ({"depth": 3}, r"unknown option\(s\) for gpt: depth \(known: layers, d_model"),
])
def test_bad_options_are_one_line(options, message):
    with pytest.raises(HvdtrainError, match=message):
        GptOptions.of(options)


@pytest.mark.parametrize("spec, options, message", [
    (DatasetSpec(input_shape=(64,), num_classes=10), {},
     r"model gpt needs token windows: .* inputs float32\[64\] and targets int64\[\]"),
    (DatasetSpec(inputs=WINDOWS.inputs, targets=WINDOWS.targets), {},
     r"gives no vocabulary size \(num_classes\); set model.options.vocab_size"),
    (WINDOWS, {"vocab_size": 100}, r"vocab_size=100 is smaller than the data's vocabulary of 256"),
    (WINDOWS, {"context": 32}, r"context=32 is shorter than the data's sequences of 64 tokens"),
])
def test_data_the_model_cannot_take_is_named(spec, options, message):
    with pytest.raises(HvdtrainError, match=message):
        gpt_shape(GptOptions.of(options), spec)


def test_means_add_derived_metrics_from_the_averages_before_the_prefix():
    sums = {"loss": 2.0 * 4, "token_accuracy": 1.0, "count": 4.0}
    out = means(sums, prefix="eval_", derived=DERIVED_METRICS)
    assert out == {"eval_loss": 2.0, "eval_token_accuracy": 0.25,
                   "eval_perplexity": pytest.approx(math.exp(2.0))}
    assert means(sums) == {"loss": 2.0, "token_accuracy": 0.25}
    assert means({"loss": 1e4, "count": 1.0}, derived=DERIVED_METRICS)["perplexity"] == math.inf
    assert math.isnan(means({"loss": math.nan, "count": 1.0},
                            derived=DERIVED_METRICS)["perplexity"])
