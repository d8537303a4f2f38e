"""hvdtrain's TensorFlow reduce-scatter in rounds (``tensorflow/collectives.py``): the sharded
engines send a large tensor in rounds (docs/sharding.md, Gloo's reduce-scatter and large
tensors). The rounds must give every rank exactly the shard one call would."""

from tests.horovod import BIN, horovodrun, rank_records


def test_rounds_give_each_rank_the_shard_one_call_gives():
    proc = horovodrun(str(BIN / "python"), "tests/horovod/tf_scatter_worker.py", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = sorted(rank_records(proc.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == [0, 1]
    for record in records:
        assert record["shapes"] == record["whole_shapes"]
        assert record["eager_equal"] and record["traced_equal"], record
    # Uneven lengths split as Horovod splits them: the first rank takes the odd element.
    assert records[0]["shapes"][1] == 2502 and records[1]["shapes"][1] == 2501
