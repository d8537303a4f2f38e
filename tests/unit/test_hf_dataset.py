"""``data.name=hf_dataset``: local JSON lines, Parquet, CSV, Arrow and save_to_disk data read with
``datasets``, as a tokenized text corpus (cached once) and as classification columns; a missing
column is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hvdtrain.data.hf_dataset import HfDataset
from hvdtrain.data.sampler import ShardedSampler
from hvdtrain.errors import HvdtrainError
from tests.conftest import ROOT

datasets = pytest.importorskip("datasets")


def paragraphs() -> list[str]:
    text = (ROOT / "docs" / "data.md").read_text()
    return [p for p in text.split("\n\n") if p.strip()]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": p, "id": i}) + "\n"
                            for i, p in enumerate(paragraphs())))
    return path


def test_text_from_json_lines_is_tokenized_once_and_cached(jsonl, tmp_path):
    options = {"path": str(jsonl), "text_column": "text", "vocab_size": 400, "seq_len": 16,
               "cache_dir": str(tmp_path / "cache")}
    first = HfDataset(**options)
    assert first.spec().num_classes == 400 and first.spec().inputs.shape == (16,)
    [corpus] = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    meta = json.loads((corpus / "meta.json").read_text())
    assert meta["tokenizer_file"] == "tokenizer.json" and meta["text_column"] == "text"
    stamp = (corpus / "train.bin").stat().st_mtime_ns
    again = HfDataset(**options)  # read from the cache, not tokenized again
    assert (corpus / "train.bin").stat().st_mtime_ns == stamp
    batch = again.train().load(np.arange(4))
    assert np.array_equal(batch.x, first.train().load(np.arange(4)).x)
    assert np.array_equal(batch.x[:, 1:], batch.y[:, :-1])
    # The last 10% of the documents are the evaluation split: its tokens decode to them.
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer.from_file(str(corpus / "tokenizer.json"))
    docs = paragraphs()
    cut = len(docs) - round(len(docs) * 0.1)
    val = np.fromfile(corpus / "val.bin", meta["dtype"]).tolist()
    assert tokenizer.decode(val) == "".join(d.rstrip("\n") + "\n" for d in docs[cut:])


def test_text_windows_are_each_sampled_once_an_epoch_over_two_ranks(jsonl, tmp_path):
    """The cached corpus is a Source like any other: the sampler's two ranks load every window
    once in an epoch, and the windows tile the training tokens."""
    data = HfDataset(path=str(jsonl), text_column="text", vocab_size=300, seq_len=16,
                     cache_dir=str(tmp_path / "cache"))
    source, sampler = data.train(), ShardedSampler(len(data.train()), 8, seed=0)
    seen = [index for rank in (0, 1) for micro in sampler.steps(1, rank, 2).micro_batches()
            for index in micro.tolist()]
    assert sorted(seen) == list(range(len(source)))
    windows = source.load(np.arange(len(source))).x
    assert np.array_equal(windows.reshape(-1), source.file.tokens[:windows.size])


def test_classification_columns_from_csv_parquet_arrow_and_save_to_disk(tmp_path):
    rng = np.random.default_rng(0)
    table = datasets.Dataset.from_dict({"a": rng.normal(size=50).tolist(),
                                        "b": rng.normal(size=50).tolist(),
                                        "label": rng.integers(0, 3, 50).tolist()})
    table.to_csv(str(tmp_path / "t.csv"), index=False)
    table.to_parquet(str(tmp_path / "t.parquet"))
    datasets.DatasetDict({"train": table.select(range(40)),
                          "test": table.select(range(40, 50))}).save_to_disk(str(tmp_path / "d"))
    table.save_to_disk(str(tmp_path / "single"))
    [arrow] = (tmp_path / "single").glob("*.arrow")
    expected = np.stack([table["a"], table["b"]], axis=1).astype(np.float32)
    for path in ("t.csv", "t.parquet", "d", str(arrow)):
        data = HfDataset(path=str(tmp_path / path), label_column="label",
                         feature_columns=["a", "b"], test_fraction=0.2)
        assert data.spec().num_classes == 3 and data.spec().input_shape == (2,), path
        assert len(data.train()) == 40 and len(data.test()) == 10, path
        batch = data.test().load(np.arange(10))
        np.testing.assert_allclose(batch.x, expected[40:], rtol=1e-6, err_msg=path)
        assert batch.y.dtype == np.int64 and batch.y.tolist() == table["label"][40:], path


@pytest.mark.parametrize("options, message", [
    ({"text_column": "body"}, "data.options.text_column='body': no such column (the data has "
                              "text, id)"),
    ({"label_column": "y", "feature_columns": ["id"]},
     "data.options.label_column='y': no such column"),
    ({"label_column": "id", "feature_columns": ["x"]},
     "data.options.feature_columns='x': no such column"),
    ({}, "give text_column (a text corpus) or label_column"),
])
def test_a_missing_column_is_one_line(jsonl, tmp_path, options, message):
    with pytest.raises(HvdtrainError) as err:
        HfDataset(path=str(jsonl), cache_dir=str(tmp_path / "cache"), **options)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_paths_that_are_not_data_are_one_line(tmp_path):
    (tmp_path / "x.txt").write_text("hello")
    (tmp_path / "empty").mkdir()
    for path, message in (("x.txt", "unknown format '.txt'"), ("nope.jsonl", "no such file"),
                          ("empty", "not one written by save_to_disk")):
        with pytest.raises(HvdtrainError, match=message):
            HfDataset(path=str(tmp_path / path), text_column="text")


def test_an_image_column_gives_channels_first_images_and_nested_lists_keep_their_shape(tmp_path):
    """Image classification columns: a ``datasets.Image`` column (from Parquet, where the
    images are PNG bytes, and from save_to_disk) gives [3, H, W] inputs in [0, 1], the pixels
    of the images; one column of nested lists keeps its shape; ragged lists are one line."""
    pytest.importorskip("PIL")
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (20, 5, 4, 3), dtype=np.uint8)
    labels = datasets.ClassLabel(names=["a", "b", "c"])
    features = datasets.Features({"image": datasets.Image(), "label": labels})
    table = datasets.Dataset.from_dict({"image": list(pixels),
                                        "label": (np.arange(20) % 3).tolist()}, features=features)
    table.to_parquet(str(tmp_path / "images.parquet"))
    table.save_to_disk(str(tmp_path / "images"))
    expected = pixels.transpose(0, 3, 1, 2).astype(np.float32) / 255
    for path in ("images.parquet", "images"):
        data = HfDataset(path=str(tmp_path / path), label_column="label",
                         feature_columns=["image"], test_fraction=0.25)
        assert data.spec().input_shape == (3, 5, 4) and data.spec().num_classes == 3, path
        batch = data.test().load(np.arange(5))
        np.testing.assert_array_equal(batch.x, expected[15:], err_msg=path)
        assert batch.y.tolist() == [0, 1, 2, 0, 1], path
    nested = datasets.Dataset.from_dict({"x": pixels[:, :, :, 0].tolist(),
                                         "y": [0, 1] * 10})
    data = HfDataset(path=_saved(nested, tmp_path / "nested"), label_column="y",
                     feature_columns=["x"])
    assert data.spec().input_shape == (5, 4)
    np.testing.assert_array_equal(data.train().load(np.arange(2)).x, pixels[:2, :, :, 0])
    ragged = datasets.Dataset.from_dict({"x": [[1.0, 2.0], [3.0]] * 5, "y": [0, 1] * 5})
    with pytest.raises(HvdtrainError) as err:
        HfDataset(path=_saved(ragged, tmp_path / "ragged"), label_column="y",
                  feature_columns=["x"])
    assert "feature_columns=['x']: not numbers or lists of one length" in str(err.value)
    assert "\n" not in str(err.value)


def _saved(table, path) -> str:
    table.save_to_disk(str(path))
    return str(path)
