"""``hvdtrain data make-text --tokenizer FILE`` against the ``tokenizers`` library's own encoding of
the same text, side by side (issue 59's target: within 10%).

A corpus of ``--mb`` megabytes (this repository's README.md and docs/*.md, repeated) is encoded by
a BPE of ``--vocab`` tokens trained on the docs once. The library's time is
``Tokenizer.encode_batch_fast`` over the same lines in the same pieces of 4,096; make-text's is
the whole of it (reading, encoding, one array of the ids, writing).
Each is run ``--repeats`` times alternately and the medians are compared.

    .venv/bin/python benchmarks/hf_tokenize.py --mb 20
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from hvdtrain.data.hf_text import CHUNK_LINES, make_tokenized_text

ROOT = Path(__file__).resolve().parents[1]


def library_seconds(tokenizer_file: Path, corpus: Path) -> float:
    """The library alone: read, split into lines, encode in pieces (the ids left as the library
    gives them: make-text's turning them into one array and writing it count against it)."""
    from tokenizers import Tokenizer

    start = time.perf_counter()
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    lines = corpus.read_text().splitlines(keepends=True)
    for k in range(0, len(lines), CHUNK_LINES):
        tokenizer.encode_batch_fast(lines[k:k + CHUNK_LINES], add_special_tokens=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=20.0)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        docs = "".join(p.read_text() + "\n" for p in [ROOT / "README.md",
                                                       *sorted((ROOT / "docs").glob("*.md"))])
        (work / "docs.md").write_text(docs)
        make_tokenized_text([work / "docs.md"], work / "trained", 0.1, "bpe", args.vocab)
        corpus = work / "corpus.md"
        corpus.write_text(docs * max(1, round(args.mb * 1e6 / len(docs.encode()))))
        tokenizer = work / "trained" / "tokenizer.json"
        ours, theirs = [], []
        for rep in range(args.repeats):
            theirs.append(library_seconds(tokenizer, corpus))
            start = time.perf_counter()
            make_tokenized_text([corpus], work / f"out{rep}", 0.1, str(tokenizer))
            ours.append(time.perf_counter() - start)
        size = corpus.stat().st_size / 1e6
        mine, lib = statistics.median(ours), statistics.median(theirs)
        print(f"corpus {size:.1f} MB, BPE {args.vocab}: make-text {mine:.2f} s "
              f"({size / mine:.1f} MB/s), tokenizers {lib:.2f} s ({size / lib:.1f} MB/s), "
              f"ratio {mine / lib:.3f} (target <= 1.10); runs: ours {ours}, theirs {theirs}")


if __name__ == "__main__":
    main()
