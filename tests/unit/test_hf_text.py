"""``hvdtrain data make-text --tokenizer``: a BPE trained on the corpus or a tokenizer file, the ids
written in the ``text`` format with the tokenizer beside them, and the one-line refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hvdtrain.cli import main
from hvdtrain.data.hf_text import make_tokenized_text
from hvdtrain.data.text import TextDataset
from hvdtrain.errors import HvdtrainError
from tests.conftest import ROOT

tokenizers = pytest.importorskip("tokenizers")

FILES = [ROOT / "README.md", ROOT / "docs" / "data.md"]


def corpus_text() -> str:
    return "".join(f.read_text().rstrip("\n") + "\n" for f in FILES)


def ids(root) -> np.ndarray:
    meta = json.loads((root / "meta.json").read_text())
    return np.concatenate([np.fromfile(root / name, meta["dtype"])
                           for name in ("train.bin", "val.bin")])


def test_a_trained_bpe_writes_ids_that_decode_to_the_corpus(tmp_path):
    meta = make_tokenized_text(FILES, tmp_path / "c", 0.1, "bpe", 600)
    assert meta["vocab_size"] == 600 and meta["dtype"] == "uint16"
    assert meta["tokenizer"] == "bpe" and meta["tokenizer_file"] == "tokenizer.json"
    tokens = ids(tmp_path / "c")
    assert len(tokens) == meta["train_tokens"] + meta["val_tokens"]
    assert len(tokens) < len(corpus_text().encode()) / 2  # merges: fewer tokens than bytes
    tokenizer = tokenizers.Tokenizer.from_file(str(tmp_path / "c" / "tokenizer.json"))
    assert tokenizer.decode(tokens.tolist()) == corpus_text()  # byte-level BPE loses nothing
    spec = TextDataset(str(tmp_path / "c"), seq_len=32).spec()
    assert spec.num_classes == 600


def test_a_tokenizer_file_gives_the_same_ids_and_is_saved_beside_them(tmp_path):
    make_tokenized_text(FILES, tmp_path / "a", 0.1, "bpe", 600)
    assert main(["data", "make-text", *map(str, FILES), "--out", str(tmp_path / "b"),
                 "--tokenizer", str(tmp_path / "a" / "tokenizer.json")]) == 0
    assert np.array_equal(ids(tmp_path / "a"), ids(tmp_path / "b"))
    assert (tmp_path / "b" / "tokenizer.json").read_text() == \
        (tmp_path / "a" / "tokenizer.json").read_text()


def test_a_tokenizer_that_does_not_match_the_ids_stops_the_corpus(tmp_path):
    make_tokenized_text(FILES, tmp_path / "a", 0.1, "bpe", 600)
    make_tokenized_text(FILES, tmp_path / "b", 0.1, "bpe", 300)
    (tmp_path / "b" / "tokenizer.json").replace(tmp_path / "a" / "tokenizer.json")
    with pytest.raises(HvdtrainError) as err:
        TextDataset(str(tmp_path / "a"))
    assert "its tokenizer tokenizer.json has 300 tokens, meta.json says vocab_size=600" in \
        str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("extra, message", [
    (["--tokenizer", "bpe", "--vocab-size", "100"], "a byte-level BPE needs at least 257 tokens"),
    (["--tokenizer", "missing.json"], "--tokenizer=missing.json: no such file"),
    (["--tokenizer", "README.md"], "--tokenizer=README.md: not a tokenizer.json"),
    (["--vocab-size", "500"], "--vocab-size is for --tokenizer bpe"),
])
def test_bad_tokenizer_options_are_one_line_and_exit_2(tmp_path, capsys, extra, message):
    code = main(["data", "make-text", str(FILES[0]), "--out", str(tmp_path / "c"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_sentencepiece_model_tokenizes_and_is_saved_beside(tmp_path):
    sentencepiece = pytest.importorskip("sentencepiece")
    (tmp_path / "train.txt").write_text(corpus_text())
    sentencepiece.SentencePieceTrainer.train(input=str(tmp_path / "train.txt"),
                                             model_prefix=str(tmp_path / "sp"), vocab_size=300,
                                             minloglevel=2)
    meta = make_tokenized_text(FILES, tmp_path / "c", 0.1, str(tmp_path / "sp.model"))
    assert meta["vocab_size"] == 300 and meta["tokenizer_file"] == "tokenizer.model"
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "c" /
                                                                    "tokenizer.model"))
    first = corpus_text().splitlines(keepends=True)[0]
    assert ids(tmp_path / "c")[:len(processor.encode(first))].tolist() == processor.encode(first)
    assert TextDataset(str(tmp_path / "c"), seq_len=16).spec().num_classes == 300


def test_the_cli_names_the_tokenizer_in_its_one_line_report(tmp_path, capsys):
    out = tmp_path / "c"
    assert main(["data", "make-text", *map(str, FILES), "--out", str(out), "--tokenizer", "bpe",
                 "--vocab-size", "600"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert (f"wrote {meta['train_tokens']} training and {meta['val_tokens']} validation tokens "
            f"(tokenizer.json, 600 ids) of 2 file(s) to {out}") in capsys.readouterr().out
