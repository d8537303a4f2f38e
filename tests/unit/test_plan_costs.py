"""The planner's formulas against hand-computed values and their limits (docs/planner.md)."""

from __future__ import annotations

import pytest

from hvdtrain.pipeline.actions import bubble
from hvdtrain.plan import costs
from hvdtrain.plan.cluster import Link
from hvdtrain.plan.fusion import fuse
from hvdtrain.plan.predict import server_layout
from hvdtrain.plan.profile import LayerProfile, TensorProfile
from hvdtrain.plan.stages import pipeline_step
from hvdtrain.ps.layout import ChunkLayout

GB = Link(bandwidth_gbit_s=8.0, latency_us=10.0)  # 1e9 bytes/s, 10 us
FAST = Link(bandwidth_gbit_s=80.0, latency_us=1.0)


def test_ring_allreduce_by_hand() -> None:
    # 4 ranks, 1e8 bytes: 2*3*10us + 2*3/4 * 0.1 s = 60 us + 0.15 s
    assert costs.ring_allreduce(1e8, 4, GB) == pytest.approx(0.15006)
    assert costs.ring_allreduce(1e8, 1, GB) == 0.0
    # Many ranks: the bandwidth term tends to 2 M/B (Patarasuk & Yuan's bound)
    big = costs.ring_allreduce(1e8, 10_000, Link(bandwidth_gbit_s=8.0, latency_us=0.0))
    assert big == pytest.approx(0.2, rel=1e-3)
    assert costs.ring_allreduce(1e8, 4, GB, overhead_s=0.01) == pytest.approx(0.16006)


def test_allgather_by_hand() -> None:
    # 3 ranks each 1e6 bytes: 2 * (10 us + 1 ms)
    assert costs.ring_allgather(1e6, 3, GB) == pytest.approx(2 * 0.00101)
    assert costs.ring_allgather(1e6, 1, GB) == 0.0


def test_flat_and_hierarchical() -> None:
    # One node of 4: a ring on the fast link.
    assert costs.flat_allreduce(1e8, 1, 4, FAST, GB) == pytest.approx(
        costs.ring_allreduce(1e8, 4, FAST))
    # 2 nodes x 2: 2*(4-1) steps of 1e8/4 bytes over the slower (inter) link.
    assert costs.flat_allreduce(1e8, 2, 2, FAST, GB) == pytest.approx(6 * (10e-6 + 0.025))
    # Hierarchical: within 2*(1)*1us + 2*(1/2)*1e8/1e10; between 2*(1)*10us + 2*(1/2)*0.1
    expect = 2e-6 + 0.01 + 20e-6 + 0.1
    assert costs.hierarchical_allreduce(1e8, 2, 2, FAST, GB) == pytest.approx(expect)
    # One rank per node: hierarchical is the ring between nodes.
    assert costs.hierarchical_allreduce(1e8, 5, 1, FAST, GB) == pytest.approx(
        costs.ring_allreduce(1e8, 5, GB))


def test_byteps_limits() -> None:
    nolat = Link(bandwidth_gbit_s=8.0, latency_us=0.0)
    n, m = 8, 1e8
    # k = 0: the ring's bandwidth term; k = n: M/B (BytePS, section 3.2)
    assert costs.byteps(m, n, 0, nolat) == pytest.approx(2 * (n - 1) / n * m / 1e9)
    assert costs.byteps(m, n, n, nolat) == pytest.approx(m / 1e9)
    # n = 4, k = 4: 2*4*3 / (16+16-8) = 1 -> M/B; the docs' 0.67 of the ring's 1.5 M/B
    assert costs.byteps(m, 4, 4, nolat) / costs.byteps(m, 4, 0, nolat) == pytest.approx(2 / 3)
    assert costs.byteps(m, 1, 0, nolat) == 0.0


def test_dedicated_ps_by_hand() -> None:
    nolat = Link(bandwidth_gbit_s=8.0, latency_us=0.0)
    # The docs' table in units of M/B: N=4, S=1 -> 4; S=2 -> 2; S=4 -> 1
    for servers, units in ((1, 4.0), (2, 2.0), (4, 1.0)):
        assert costs.dedicated_ps(1e9, 4, servers, nolat, nolat) == pytest.approx(units)
    # Summing at 2e9 bytes/s adds N M / (S R) = 4e9 / 8e9
    assert costs.dedicated_ps(1e9, 4, 4, nolat, nolat, 2e9) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        costs.dedicated_ps(1e9, 4, 0, nolat, nolat)
    # The busiest server holds 0.3 of the vector (not 1/4): 4 x 0.3 = 1.2 M/B; the last chunk's
    # pull (1e8 bytes to each of 4 workers) adds 0.4
    assert costs.dedicated_ps(1e9, 4, 4, nolat, nolat, share=0.3) == pytest.approx(1.2)
    assert costs.dedicated_ps(1e9, 4, 4, nolat, nolat, chunk=1e8) == pytest.approx(1.4)


def test_server_layout_is_hvdtrains_cut() -> None:
    # 17.4 MB of float32 with 4 MiB at most: cut into 64 chunks of 68 K elements (265 KiB)
    share, chunk = server_layout(4 * 4_345_490, 4, 4096)
    assert chunk == 4 * -(-4_345_490 // 64)
    layout = ChunkLayout(4_345_490, int(chunk) // 4, 4)
    assert share == max(layout.elements(s) for s in range(4)) / 4_345_490
    assert 0.25 <= share < 0.3
    assert server_layout(4 * 4_345_490, 1, 4096)[0] == 1.0


def _tensors(*pairs: tuple[int, float]) -> list[TensorProfile]:
    return [TensorProfile(f"t{i}", b, r) for i, (b, r) in enumerate(pairs)]


def test_fusion_cycles_and_threshold() -> None:
    tensors = _tensors((100, 0.0005), (100, 0.0015), (100, 0.0016), (300, 0.0100))
    buckets = fuse(tensors, lambda b: b * 1e-5, cycle_s=0.001, threshold=250)
    # cycle at 1 ms takes t0 (1 ms of comm: ends 2 ms); at 2 ms t1+t2 fused (ends 4 ms);
    # t3 at 10 ms, alone (larger than the threshold): ends 13 ms.
    assert [b.tensors for b in buckets] == [("t0",), ("t1", "t2"), ("t3",)]
    assert [round(b.start_s, 6) for b in buckets] == [0.001, 0.002, 0.010]
    assert buckets[-1].end_s == pytest.approx(0.013)
    # A threshold below two tensors splits one cycle's tensors into two buffers, back to back.
    split = fuse(_tensors((100, 0.0), (100, 0.0)), lambda b: 0.001, cycle_s=0.001, threshold=150)
    assert [(b.start_s, b.end_s) for b in split] == [(0.0, 0.001), (0.001, 0.002)]
    # Cycle time 0: each tensor as soon as ready and the link free.
    eager = fuse(_tensors((1, 0.5), (1, 1.0)), lambda b: 0.1, cycle_s=0.0)
    assert [b.start_s for b in eager] == [0.5, 1.0]


def test_pipeline_bubble_from_the_simulator() -> None:
    layers = [LayerProfile(f"l{i}", 10, 0.1, 0.2, 1000) for i in range(4)]
    for schedule in ("gpipe", "1f1b"):
        step = pipeline_step(layers, 2, 6, schedule, 1.0, 1.0, lambda b: 0.0)
        # 2 layers per stage: forward 0.2, backward 0.4 per micro-batch; span (m+P-1)(f+b)
        assert step.span_s == pytest.approx(7 * 0.6)
        assert step.bubble == pytest.approx(bubble(2, 6))
        assert step.stage_bytes == [80, 80]
    # A transfer adds to each micro-batch's forward and backward on the slowest cut.
    slow = pipeline_step(layers, 2, 6, "1f1b", 1.0, 0.5, lambda b: b * 1e-4)
    assert slow.transfer_s == pytest.approx(0.05)
    assert slow.span_s == pytest.approx(7 * 0.7)
    # Unblocked sends (the PyTorch engine's): the transfers overlap the passes but for the round
    # trip stage 0 waits on, once every two micro-batches in torch's 1F1B (worked by hand: 4.5 s
    # against 4.9 with blocking messages).
    torch = pipeline_step(layers, 2, 6, "1f1b", 1.0, 0.5, lambda b: b * 1e-4, unblocked=True)
    assert torch.transfer_s == pytest.approx(0.05)
    assert torch.span_s == pytest.approx(4.5)
    assert torch.busy_s == pytest.approx(6 * 0.6) and torch.forward_s == pytest.approx(0.2)
    # A transfer longer than a pass: the link, not the stages, paces the micro-batches.
    jammed = pipeline_step(layers, 2, 6, "gpipe", 1.0, 5.0, lambda b: b * 1e-4, unblocked=True)
    assert jammed.span_s > 6 * 0.5 + 0.6


def test_interleaved_1f1b_cuts_the_bubble_by_v_for_v_times_the_transfers() -> None:
    layers = [LayerProfile(f"l{i}", 10, 0.1, 0.2, 1000) for i in range(8)]
    # P=2, v=2: 4 pieces of 2 layers, a rank's two pieces 4 layers: f 0.4, b 0.8 a micro-batch.
    step = pipeline_step(layers, 2, 6, "interleaved_1f1b", 1.0, 1.0, lambda b: 0.0, virtual=2)
    assert step.span_s == pytest.approx((6 + 1 / 2) * 1.2)  # (m + (P-1)/v)(f + b)
    assert step.bubble == pytest.approx(1 / (2 * 6 + 1))  # (P-1)/(v m + P-1)
    assert step.stage_bytes == [160, 160]
    one = pipeline_step(layers, 2, 6, "1f1b", 1.0, 1.0, lambda b: 0.0)
    assert step.bubble < one.bubble and step.busy_s == pytest.approx(one.busy_s)
    # Each of a rank's v pieces sends its activation on: v transfers a pass where 1F1B has one.
    slow = pipeline_step(layers, 2, 6, "interleaved_1f1b", 1.0, 1.0, lambda b: 0.01, virtual=2)
    assert slow.forward_s == pytest.approx(0.4 + 2 * 0.01)


def test_calibration_recovers_the_link() -> None:
    from hvdtrain.plan.calibrate import SIZES, Sweep, cluster_tree, fit_line, link_of

    assert fit_line([1, 2, 3], [3, 5, 7]) == pytest.approx((1.0, 2.0))
    b, a, o = 1e9, 1e-4, 5e-5  # bytes/s, s, s: broadcast a + m/B, allreduce o + 2a + m/B
    sweep = Sweep(SIZES, tuple(a + m / b for m in SIZES), tuple(o + 2 * a + m / b for m in SIZES))
    gbit, latency_us, overhead_us = link_of(sweep)
    assert (gbit, latency_us, overhead_us) == pytest.approx((8.0, 100.0, 50.0))
    tree = cluster_tree(sweep, ["a", "b"], 1, "gloo")
    assert tree["nodes"] == 2 and tree["calibration"]["measured"] == "inter"
    assert tree["calibration"]["controller"] == "gloo" and tree["calibration"]["ranks"] == 2


@pytest.mark.parametrize("n", [3, 4, 8])
def test_calibration_over_n_ranks_recovers_the_ring(n: int) -> None:
    from hvdtrain.plan.calibrate import SIZES, Sweep, link_of
    from hvdtrain.plan.cluster import Link
    from hvdtrain.plan.costs import ring_allreduce

    link = Link(bandwidth_gbit_s=0.08, latency_us=300.0)  # a ring reaching 80 Mbit/s
    o = 2e-4
    allreduce = tuple(ring_allreduce(m, n, link, o) for m in SIZES)
    sweep = Sweep(SIZES, tuple(link.latency_s + m / link.bytes_per_s for m in SIZES), allreduce, n)
    assert link_of(sweep) == pytest.approx((0.08, 300.0, 200.0))
    # A broadcast dearer than a ring step (a tree of messages): the latency is what the smallest
    # allreduce leaves for 2(n-1) of them, so the formula still gives the smallest allreduce back.
    slow = Sweep(SIZES, tuple(3 * t for t in sweep.broadcast_s), allreduce, n)
    gbit, latency_us, overhead_us = link_of(slow)
    fitted = Link(bandwidth_gbit_s=gbit, latency_us=latency_us)
    assert ring_allreduce(SIZES[0], n, fitted, overhead_us * 1e-6) == pytest.approx(allreduce[0])
    assert latency_us == pytest.approx(300.0 + 100.0 / (n - 1)) and overhead_us == pytest.approx(0)


def test_a_calibrated_ring_is_priced_from_its_sweep() -> None:
    from hvdtrain.plan.calibrate import SIZES
    from hvdtrain.plan.cluster import cluster_from_tree

    # A shaped link's sweep: the smallest sizes on alpha-beta's line, the larger half on a line as
    # steep but through 60 ms (8 ranks, 80 Mbit/s, 300 us): what a straight line leaves out.
    n, b, a = 8, 1e7, 3e-4
    seconds = [2 * (n - 1) * a + 2 * (n - 1) / n * m / b + (0.06 if m >= SIZES[3] else 0.0)
               for m in SIZES]
    tree = {"nodes": n, "ranks_per_node": 1, "intra": {"bandwidth_gbit_s": 10, "latency_us": 1},
            "inter": {"bandwidth_gbit_s": 0.08, "latency_us": 300},
            "calibration": {"ranks": n, "sizes": list(SIZES), "allreduce_s": seconds,
                            "broadcast_s": [a + m / b for m in SIZES]}}
    link = cluster_from_tree(tree).inter
    # At the sweep's own sizes the ring gives back what was measured ...
    assert [costs.ring_allreduce(m, n, link) for m in SIZES] == pytest.approx(seconds)
    # ... between them it is interpolated, beyond the largest the excess is held (60 ms) ...
    bare = Link(bandwidth_gbit_s=0.08, latency_us=300)
    for m, excess in [((SIZES[4] + SIZES[5]) / 2, 0.06), (1e9, 0.06),
                      ((SIZES[2] + SIZES[3]) / 2, 0.03)]:  # halfway from 0 to 60 ms
        assert costs.ring_allreduce(m, n, link) - costs.ring_allreduce(m, n, bare) == \
            pytest.approx(excess)
    # ... a step of another ring count pays the excess of its own chunk, a link shared by g
    # flows that of a g times larger chunk, and a link edited to another rate keeps it.
    assert costs.ring_allreduce(SIZES[-1] / 2, 4, link) == pytest.approx(
        costs.ring_allreduce(SIZES[-1] / 2, 4, bare) + 6 * 0.06 / 14)
    assert link.shared(4).step_s(SIZES[-1] / n / 4) == pytest.approx(
        bare.latency_s + SIZES[-1] / n / b + 0.06 / 14)
    faster = cluster_from_tree({**tree, "inter": {"bandwidth_gbit_s": 0.8, "latency_us": 300}})
    assert costs.ring_allreduce(SIZES[-1], n, faster.inter) == pytest.approx(
        costs.ring_allreduce(SIZES[-1], n, Link(bandwidth_gbit_s=0.8, latency_us=300)) + 0.06)
    assert not cluster_from_tree({k: v for k, v in tree.items() if k != "calibration"}).inter.excess


def test_micro_batches_pay_the_fixed_part_whole() -> None:
    from hvdtrain.errors import ConfigError
    from hvdtrain.plan.profile import LayerProfile, fixed_part, profile_from_tree
    from hvdtrain.plan.stages import pipeline_step

    # 10 ms at 32 samples, 4 ms at 8: a line with 2 ms fixed and 0.25 ms a sample.
    assert fixed_part(0.010, 0.004, 32, 8) == pytest.approx(0.002)
    assert fixed_part(0.010, 0.0025, 32, 8) == 0.0  # scales with the batch: no fixed part
    assert fixed_part(0.010, 0.012, 32, 8) == pytest.approx(0.010)  # capped at the whole
    assert fixed_part(0.010, 0.004, 8, 8) == 0.0
    plain = LayerProfile("fc", 100, 0.010, 0.020, 64)
    fixed = LayerProfile("fc", 100, 0.010, 0.020, 64, 0.002, 0.008)
    assert plain.seconds(0.25, 0.5) == pytest.approx((0.005, 0.010))
    assert fixed.seconds(0.25, 0.5) == pytest.approx(((0.002 + 0.002) / 0.5, (0.008 + 0.003) / 0.5))
    assert fixed.seconds(1.0, 1.0) == pytest.approx((0.010, 0.020))  # the whole batch as profiled
    layers = [fixed, LayerProfile("head", 10, 0.010, 0.020, 64, 0.002, 0.008)]
    small = pipeline_step(layers, 2, 8, "1f1b", 0.25, 0.25, lambda b: 0.0)
    linear = pipeline_step([plain, plain], 2, 8, "1f1b", 0.25, 0.25, lambda b: 0.0)
    assert small.forward_s == pytest.approx(0.004) and linear.forward_s == pytest.approx(0.0025)
    assert small.span_s > linear.span_s
    tree = {"format": "hvdtrain-plan-profile/1", "model": {"name": "m"}, "batch_size": 32,
            "forward_s": 0.01, "backward_s": 0.02, "tensors": [{"name": "w", "bytes": 4,
                                                                "ready_s": 0.0}],
            "layers": [{"name": "fc", "params": 1, "forward_s": 0.01, "backward_s": 0.02,
                        "activation_bytes": 4, "fixed_backward_s": 0.03}]}
    with pytest.raises(ConfigError, match=r"layers\[0\]: fixed_backward_s=0.03: must be <= "):
        profile_from_tree(tree)
    tree["layers"][0]["fixed_backward_s"] = 0.01
    assert profile_from_tree(tree).layers[0].fixed_backward_s == 0.01
