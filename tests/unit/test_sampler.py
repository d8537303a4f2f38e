"""The sharding sampler: exactly once per epoch across ranks, deterministic, reshuffled per epoch."""

import numpy as np
import pytest

from hvdtrain.data.sampler import ShardedSampler, eval_shards


def epoch_indices(sampler, epoch, rank, size, start=0):
    steps = list(sampler.steps(epoch, rank, size, start))
    return steps, np.concatenate([m for s in steps for m in s.micro])


@pytest.mark.parametrize("n, batch, size, accum", [
    (1437, 32, 2, 1), (1437, 32, 3, 2), (10, 4, 4, 1), (7, 2, 8, 3), (64, 8, 2, 4)])
def test_every_index_exactly_once_per_epoch(n, batch, size, accum):
    sampler = ShardedSampler(n, batch, accumulation=accum, seed=3)
    seen, counts = [], set()
    for rank in range(size):
        steps, idx = epoch_indices(sampler, 0, rank, size)
        seen.append(idx)
        counts.add(len(steps))
        assert all(len(s.micro) == accum for s in steps)
    assert counts == {sampler.steps_in_epoch(size)}  # every rank runs the same number of steps
    allidx = np.concatenate(seen)
    assert sorted(allidx.tolist()) == list(range(n))


def test_global_count_is_the_sum_of_rank_shares():
    sampler = ShardedSampler(1437, 32, accumulation=2)
    per_rank = [list(sampler.steps(1, r, 3)) for r in range(3)]
    for step_parts in zip(*per_rank, strict=True):
        shares = sum(len(m) for part in step_parts for m in part.micro)
        assert {p.global_count for p in step_parts} == {shares}


def test_deterministic_per_seed_and_epoch_and_different_across_epochs():
    a = ShardedSampler(500, 16, seed=7)
    b = ShardedSampler(500, 16, seed=7)
    assert np.array_equal(epoch_indices(a, 2, 1, 2)[1], epoch_indices(b, 2, 1, 2)[1])
    assert not np.array_equal(epoch_indices(a, 2, 1, 2)[1], epoch_indices(a, 3, 1, 2)[1])
    assert not np.array_equal(a.permutation(0), ShardedSampler(500, 16, seed=8).permutation(0))


def test_global_batches_do_not_depend_on_how_they_are_split():
    # One rank with batch 2b sees the same step sets as two ranks with batch b.
    one = ShardedSampler(100, 20, seed=1)
    two = ShardedSampler(100, 10, seed=1)
    for s1, s2a, s2b in zip(one.steps(0, 0, 1), two.steps(0, 0, 2), two.steps(0, 1, 2), strict=True):
        assert set(s1.micro[0]) == set(s2a.micro[0]) | set(s2b.micro[0])


def test_resume_from_a_position_continues_the_same_epoch_at_another_world_size():
    sampler = ShardedSampler(103, 5, seed=2)
    first = np.concatenate([m for r in range(2) for s in list(sampler.steps(4, r, 2))[:3]
                            for m in s.micro])
    consumed = 3 * sampler.step_samples(2)
    rest = np.concatenate([epoch_indices(sampler, 4, r, 3, start=consumed)[1] for r in range(3)])
    assert sorted(np.concatenate([first, rest]).tolist()) == list(range(103))


def test_no_shuffle_keeps_order():
    sampler = ShardedSampler(6, 3, shuffle=False)
    assert epoch_indices(sampler, 5, 0, 1)[1].tolist() == [0, 1, 2, 3, 4, 5]


def test_eval_shards_cover_the_split_and_give_every_rank_a_batch():
    parts = [np.concatenate(list(eval_shards(11, r, 3, 2))) for r in range(3)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(11))
    assert [len(list(eval_shards(1, r, 2, 4))) for r in range(2)] == [1, 1]


def test_eval_shards_give_every_rank_as_many_batches():
    """37 samples at 2 ranks in batches of 2: 19 and 18 samples, 10 batches each (rank 1's last
    one empty), so that a stage-3 model's gathers in each forward pair up across the ranks."""
    batches = [list(eval_shards(37, r, 2, 2)) for r in range(2)]
    assert [len(b) for b in batches] == [10, 10]
    assert [len(b[-1]) for b in batches] == [1, 0]
    assert sorted(np.concatenate([np.concatenate(b) for b in batches]).tolist()) == list(range(37))
