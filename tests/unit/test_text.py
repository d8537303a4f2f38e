"""The ``text`` data format and ``hvdtrain data make-text``, without a framework."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hvdtrain.cli import main
from hvdtrain.data.contracts import ArraySpec
from hvdtrain.data.sampler import ShardedSampler
from hvdtrain.data.text import TextDataset, make_text
from hvdtrain.errors import HvdtrainError

TEXT = "The quick brown fox jumps over the lazy dog.\n" * 20  # 900 bytes


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.md").write_text("# b\n\nsecond file\n")
    return make_text([tmp_path / "a.txt", tmp_path / "b.md"], tmp_path / "corpus", 0.25), \
        tmp_path / "corpus"


def write_corpus(root, tokens, meta):
    root.mkdir(parents=True)
    np.asarray(tokens[0]).tofile(root / "train.bin")
    np.asarray(tokens[1]).tofile(root / "val.bin")
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def test_make_text_writes_the_bytes_of_the_files_in_order_with_the_last_fraction_for_val(corpus):
    meta, root = corpus
    data = (TEXT + "# b\n\nsecond file\n").encode()
    train, val = (np.fromfile(root / name, np.uint8).tobytes() for name in ("train.bin", "val.bin"))
    assert train + val == data and len(val) == round(len(data) * 0.25)
    assert meta == json.loads((root / "meta.json").read_text())
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint8"
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))


def test_make_text_refuses_what_it_cannot_make(corpus, tmp_path):
    _, root = corpus
    with pytest.raises(HvdtrainError, match="exists and is not an empty directory"):
        make_text([tmp_path / "a.txt"], root)
    with pytest.raises(HvdtrainError, match=r"--val-fraction=1.0: must be in \(0, 1\)"):
        make_text([tmp_path / "a.txt"], tmp_path / "new", 1.0)
    with pytest.raises(HvdtrainError, match=r"missing\.txt is not a file"):
        make_text([tmp_path / "missing.txt"], tmp_path / "new")
    (tmp_path / "tiny.txt").write_text("ab")
    with pytest.raises(HvdtrainError, match="3 bytes of text leave a split empty"):
        make_text([tmp_path / "tiny.txt"], tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_windows_do_not_overlap_and_targets_are_the_next_tokens(corpus):
    meta, root = corpus
    data = TextDataset(str(root), seq_len=16)
    spec = data.spec()
    assert spec.inputs == spec.targets == ArraySpec((16,), "int64") and spec.num_classes == 256
    train = data.train()
    assert len(train) == (meta["train_tokens"] - 1) // 16 and len(data.test()) == (229 - 1) // 16
    batch = train.load(np.arange(len(train))[::-1])
    assert batch.x.dtype == batch.y.dtype == np.int64 and batch.x.shape == (len(train), 16)
    tokens = np.fromfile(root / "train.bin", np.uint8).astype(np.int64)
    x, y = batch.x[::-1], batch.y[::-1]
    assert np.array_equal(x.reshape(-1), tokens[:len(train) * 16])  # every token once, in order
    assert np.array_equal(y.reshape(-1), tokens[1:len(train) * 16 + 1])
    assert train.load(np.zeros(0, np.int64)).y.shape == (0, 16)


def test_the_global_batch_sampler_gives_every_window_once_an_epoch(corpus):
    data = TextDataset(str(corpus[1]), seq_len=8)
    sampler = ShardedSampler(len(data.train()), 5, seed=0, shuffle=True)
    seen = [idx for rank in (0, 1) for step in sampler.steps(0, rank, 2)
            for micro in step.micro for idx in micro]
    assert sorted(seen) == list(range(len(data.train())))


def test_nanogpt_uint16_tokens_and_their_vocabulary_are_checked(tmp_path):
    tokens = np.arange(40, dtype="<u2") * 9, np.arange(10, dtype="<u2")
    root = write_corpus(tmp_path / "c", tokens, {"vocab_size": 300, "dtype": "uint16"})
    data = TextDataset(str(root), seq_len=4)
    assert data.spec().num_classes == 300
    assert data.train().load(np.array([1])).x.tolist() == [[36, 45, 54, 63]]
    with pytest.raises(HvdtrainError, match=r"train.bin: window 8 holds token 324, outside the "
                                            r"vocabulary of 300 \(meta.json\)"):
        data.train().load(np.array([0, 8]))
    data.train().load(np.array([7]))  # the highest window inside the vocabulary loads


@pytest.mark.parametrize("meta, files, message", [
    (None, True, "meta.json not found"),
    ("{not json", True, "meta.json: not readable JSON"),
    ([1, 2], True, "meta.json: expected a JSON object with vocab_size and dtype"),
    ({"vocab_size": 256, "dtype": "int8"}, True,
     "dtype='int8', expected one of uint8, uint16, uint32"),
    ({"vocab_size": 300, "dtype": "uint8"}, True,
     r"vocab_size=300, expected an integer in \[2, 256\] for uint8 tokens"),
    ({"vocab_size": 256, "dtype": "uint8", "train_tokens": 5}, True,
     "train.bin: holds 64 tokens, meta.json says train_tokens=5"),
    ({"vocab_size": 256, "dtype": "uint16"}, True,
     "val.bin: 9 bytes is not a whole number of uint16 tokens"),
    ({"vocab_size": 256, "dtype": "uint8"}, False, r"c: train.bin not found"),
])
def test_a_bad_corpus_is_one_line_naming_the_file(tmp_path, meta, files, message):
    root = tmp_path / "c"
    root.mkdir()
    if files:
        np.zeros(64, np.uint8).tofile(root / "train.bin")
        np.zeros(9, np.uint8).tofile(root / "val.bin")
    if meta is not None:
        (root / "meta.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    with pytest.raises(HvdtrainError, match=message) as caught:
        TextDataset(str(root), seq_len=4)
    assert "\n" not in str(caught.value)


def test_a_missing_directory_or_a_corpus_shorter_than_a_window_says_so(corpus, tmp_path):
    with pytest.raises(HvdtrainError, match=r"data.options.root='.*nowhere': no such directory "
                                            r"\(make a corpus with `hvdtrain data make-text"):
        TextDataset(str(tmp_path / "nowhere"))
    with pytest.raises(HvdtrainError, match=r"val.bin: 229 tokens, shorter than one window of "
                                            r"seq_len \+ 1 = 257; lower data.options.seq_len"):
        TextDataset(str(corpus[1]), seq_len=256)
    with pytest.raises(HvdtrainError, match=r"data.options.seq_len=0: expected a positive"):
        TextDataset(str(corpus[1]), seq_len=0)


def test_the_cli_makes_a_corpus_and_reports_errors_in_one_line(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(TEXT)
    out = tmp_path / "corpus"
    assert main(["data", "make-text", str(tmp_path / "a.txt"), "--out", str(out),
                 "--val-fraction", "0.5"]) == 0
    assert f"wrote 450 training and 450 validation byte tokens of 1 file(s) to {out}" in \
        capsys.readouterr().out
    assert main(["data", "make-text", str(tmp_path / "a.txt"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hvdtrain: error: data make-text:") and err.count("\n") == 1
