"""The check that a tokenized corpus's tokenizer matches its ids (docs/huggingface.md): read by
the ``text`` format when ``meta.json`` names a ``tokenizer_file`` (written by ``hvdtrain data
make-text --tokenizer``, :mod:`hvdtrain.data.hf_text`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hvdtrain.errors import HvdtrainError

META = "meta.json"


def tokenizer_size(path: Path) -> int:
    """The vocabulary of a ``tokenizer.json`` or sentencepiece ``.model`` file, added tokens
    included."""
    if path.suffix == ".model":
        import sentencepiece

        return int(sentencepiece.SentencePieceProcessor(model_file=str(path)).get_piece_size())
    from tokenizers import Tokenizer

    return int(Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True))


def check_tokenizer(root: Path, meta: dict[str, Any]) -> None:
    """Raises one line when the tokenizer that ``meta`` names beside a corpus is missing or its
    vocabulary is not the corpus's ``vocab_size`` (the ids were made by another tokenizer)."""
    name = meta.get("tokenizer_file")
    if name is None:
        return
    path = root / str(name)
    if Path(str(name)).name != name or not path.is_file():
        raise HvdtrainError(f"text corpus {root}: {META} names tokenizer_file={name!r}, which is "
                            "not a file beside it")
    try:
        size = tokenizer_size(path)
    except Exception as exc:  # noqa: BLE001  (either library's own error: one line naming it)
        first = str(exc).strip().splitlines() or [type(exc).__name__]
        raise HvdtrainError(f"text corpus {root}: its tokenizer {name} is not readable "
                            f"({first[0]})") from None
    if size != meta.get("vocab_size"):
        raise HvdtrainError(f"text corpus {root}: its tokenizer {name} has {size} tokens, "
                            f"{META} says vocab_size={meta.get('vocab_size')!r} (the ids were "
                            "made by another tokenizer)")
