"""The pipeline schedules (hvdtrain.pipeline.actions): every stage's action list, run with
blocking messages in one process, completes, keeps its memory bound, has the known bubble, and
computes the unsplit model's gradients (NumPy stages)."""

import numpy as np
import pytest

from hvdtrain.pipeline import actions as sch
from hvdtrain.pipeline.actions import Action

CASES = [(schedule, stages, micro) for schedule in sch.ORDERED
         for stages in range(1, 7) for micro in range(0, 10)]


def stage_lists(schedule: str, stages: int, micro: int) -> list[list[Action]]:
    return [sch.actions(schedule, s, stages, micro) for s in range(stages)]


@pytest.mark.parametrize(("schedule", "stages", "micro"), CASES)
def test_each_forward_precedes_its_backward_once(schedule, stages, micro):
    for s, todo in enumerate(stage_lists(schedule, stages, micro)):
        passes = [a for a in todo if a.kind in sch.COMPUTE]
        assert sorted(a.micro for a in passes if a.kind == sch.FORWARD) == list(range(micro))
        assert sorted(a.micro for a in passes if a.kind == sch.BACKWARD) == list(range(micro))
        for i in range(micro):
            assert todo.index(Action(sch.FORWARD, i)) < todo.index(Action(sch.BACKWARD, i))
            if s > 0:  # the input arrives before the pass, its gradient leaves after
                assert todo.index(Action(sch.RECV_ACTIVATION, i)) < todo.index(Action(sch.FORWARD, i))
                assert todo.index(Action(sch.SEND_GRADIENT, i)) > todo.index(Action(sch.BACKWARD, i))
            if s < stages - 1:
                assert todo.index(Action(sch.SEND_ACTIVATION, i)) > todo.index(Action(sch.FORWARD, i))
                assert todo.index(Action(sch.RECV_GRADIENT, i)) < todo.index(Action(sch.BACKWARD, i))
        kinds = {a.kind for a in todo}
        assert (sch.RECV_ACTIVATION in kinds) == (s > 0 and micro > 0)
        assert (sch.SEND_ACTIVATION in kinds) == (s < stages - 1 and micro > 0)


@pytest.mark.parametrize(("schedule", "stages", "micro"), CASES)
def test_blocking_messages_complete_with_the_known_bubble(schedule, stages, micro):
    lists = stage_lists(schedule, stages, micro)
    for forward_s, backward_s in ((1.0, 1.0), (1.0, 2.0)):
        timeline = sch.simulate(lists, forward_s, backward_s)
        assert len(timeline.trace) == sum(map(len, lists))
        if micro:
            assert timeline.bubble == pytest.approx(sch.bubble(stages, micro), abs=1e-12)
            assert max(timeline.finish) == pytest.approx((micro + stages - 1)
                                                         * (forward_s + backward_s))


@pytest.mark.parametrize(("stages", "micro"), [(p, m) for p in range(1, 7) for m in range(1, 10)])
def test_1f1b_holds_at_most_p_minus_s_in_flight_and_gpipe_all(stages, micro):
    for s in range(stages):
        assert sch.in_flight(sch.actions("1f1b", s, stages, micro)) == min(stages - s, micro)
        assert sch.in_flight(sch.actions("gpipe", s, stages, micro)) == micro


def test_the_simulator_reports_a_deadlock_and_a_mismatch():
    # Stage 1 waits for stage 2, which has nothing to send; stage 0 waits for stage 1.
    stuck = [[Action(sch.SEND_ACTIVATION, 0)],
             [Action(sch.RECV_GRADIENT, 0), Action(sch.RECV_ACTIVATION, 0)], []]
    with pytest.raises(RuntimeError, match=r"deadlock: stage 0: send_activation\(0\); "
                                           r"stage 1: recv_gradient\(0\)"):
        sch.simulate(stuck)
    # Both ends send at once: with rendezvous messages, each waits for the other for ever.
    crossed = [[Action(sch.SEND_ACTIVATION, 0)], [Action(sch.SEND_GRADIENT, 0)]]
    with pytest.raises(RuntimeError, match=r"send_activation\(0\) meets stage 1 send_gradient"):
        sch.simulate(crossed)


@pytest.mark.parametrize(("schedule", "stages", "micro"), CASES)
def test_unblocked_sends_complete_and_free_messages_keep_the_bubble(schedule, stages, micro):
    """torch's orders, run with unblocked sends, complete: with free messages in the span of the
    rendezvous lists; its 1F1B holds one micro-batch more than PipeDream-Flush's."""
    lists = [sch.unblocked_actions(schedule, s, stages, micro) for s in range(stages)]
    for s, todo in enumerate(lists):
        for i in range(micro):
            assert todo.index(Action(sch.FORWARD, i)) < todo.index(Action(sch.BACKWARD, i))
        assert sorted(a.micro for a in todo if a.kind == sch.SEND_ACTIVATION) == (
            list(range(micro)) if s < stages - 1 else [])
        assert sorted(a.micro for a in todo if a.kind == sch.SEND_GRADIENT) == (
            list(range(micro)) if s > 0 else [])
        assert sch.in_flight(todo) == (micro if schedule == "gpipe" else min(stages - s, micro))
    free = sch.simulate_unblocked(lists, 1.0, 2.0, 0.0)
    assert len(free.trace) == sum(map(len, lists))
    rendezvous = sch.simulate(stage_lists(schedule, stages, micro), 1.0, 2.0)
    assert max(free.finish, default=0.0) == pytest.approx(max(rendezvous.finish, default=0.0))
    slow = sch.simulate_unblocked(lists, 1.0, 2.0, 0.5)
    # Every message on the critical path (P - 1 hops each way) is paid once, no more.
    assert max(slow.finish, default=0.0) >= max(free.finish, default=0.0) + (
        (stages - 1) * 2 * 0.5 if micro else 0.0) - 1e-12


def test_unblocked_sends_overlap_the_next_pass():
    """Two stages, GPipe, two micro-batches, passes of 1 s and messages of 0.5 s: stage 1 starts
    at 1.5 s and runs on; the second activation waits for the first to leave the link (2.0-2.5 s);
    stage 0 takes the last gradient at 6 s and finishes at 7 s, 2 x 0.5 s after the rendezvous'
    span with free messages, (m + P - 1)(f + b) = 6 s."""
    run = sch.simulate_unblocked(stage_lists("gpipe", 2, 2), 1.0, 1.0, 0.5)
    assert run.finish == pytest.approx([7.0, 5.5])
    torch = [sch.unblocked_actions("gpipe", s, 2, 2) for s in range(2)]
    assert sch.simulate_unblocked(torch, 1.0, 1.0, 0.5).finish == pytest.approx([7.0, 5.5])
    assert run.busy == [4.0, 4.0]
    long = sch.simulate_unblocked(stage_lists("gpipe", 2, 2), 1.0, 1.0, 3.0)
    assert long.finish[1] == pytest.approx(1 + 3 + 3 + 1 + 1 + 1)  # a1 leaves after a0: 7 s


def test_the_unblocked_simulator_reports_a_deadlock_and_a_mismatch():
    with pytest.raises(RuntimeError, match=r"deadlock: stage 0: recv_gradient\(0\)"):
        sch.simulate_unblocked([[Action(sch.RECV_GRADIENT, 0)], []], 1.0, 1.0, 0.1)
    crossed = [[Action(sch.SEND_ACTIVATION, 1)], [Action(sch.RECV_ACTIVATION, 0)]]
    with pytest.raises(RuntimeError, match=r"recv_activation\(0\) receives stage 0 "
                                           r"send_activation\(1\)"):
        sch.simulate_unblocked(crossed, 1.0, 1.0, 0.1)
    with pytest.raises(RuntimeError, match="has no neighbour"):
        sch.simulate_unblocked([[Action(sch.SEND_GRADIENT, 0)]], 1.0, 1.0, 0.1)


def test_a_wrong_schedule_or_stage_is_refused():
    with pytest.raises(ValueError, match="interleaved"):
        sch.actions("interleaved", 0, 2, 4)
    with pytest.raises(ValueError, match=r"stage 2 is not in 0\.\.1"):
        sch.actions("1f1b", 2, 2, 4)


def test_1f1b_steady_state_swaps_a_gradient_for_an_activation():
    """The orders of the module docstring, spelled out for P = 2, m = 3."""
    names = [[str(a) for a in todo] for todo in stage_lists("1f1b", 2, 3)]
    assert names[0] == ["forward(0)", "send_activation(0)", "forward(1)", "recv_gradient(0)",
                        "send_activation(1)", "backward(0)", "forward(2)", "recv_gradient(1)",
                        "send_activation(2)", "backward(1)", "recv_gradient(2)", "backward(2)"]
    assert names[1] == ["recv_activation(0)", "forward(0)", "backward(0)", "send_gradient(0)",
                        "recv_activation(1)", "forward(1)", "backward(1)", "send_gradient(1)",
                        "recv_activation(2)", "forward(2)", "backward(2)", "send_gradient(2)"]


class NumpyStage:
    """One tanh layer of a pipelined network, running its actions on NumPy arrays."""

    def __init__(self, weight: np.ndarray, last: bool, targets: list[np.ndarray]) -> None:
        self.weight, self.last, self.targets = weight, last, targets
        self.grad = np.zeros_like(weight)
        self.inputs: dict[int, np.ndarray] = {}
        self.outputs: dict[int, np.ndarray] = {}
        self.out_grads: dict[int, np.ndarray] = {}
        self.in_grads: dict[int, np.ndarray] = {}

    def forward(self, i: int) -> None:
        self.outputs[i] = np.tanh(self.inputs[i] @ self.weight)

    def backward(self, i: int) -> None:
        out = self.outputs.pop(i)
        # The last stage's loss is the summed squared error against the micro-batch's targets.
        g = 2 * (out - self.targets[i]) if self.last else self.out_grads.pop(i)
        pre = g * (1 - out ** 2)
        self.grad += self.inputs[i].T @ pre
        self.in_grads[i] = pre @ self.weight.T
        del self.inputs[i]


@pytest.mark.parametrize("schedule", sch.ORDERED)
@pytest.mark.parametrize(("stages", "micro"), [(1, 3), (2, 1), (2, 4), (3, 2), (4, 6)])
def test_numpy_stages_compute_the_unsplit_gradient(schedule, stages, micro):
    rng = np.random.default_rng(stages * 10 + micro)
    width, batch = 5, 3
    weights = [rng.normal(size=(width, width)) / width for _ in range(stages)]
    xs = [rng.normal(size=(batch, width)) for _ in range(micro)]
    ys = [rng.normal(size=(batch, width)) for _ in range(micro)]
    nodes = [NumpyStage(w.copy(), s == stages - 1, ys) for s, w in enumerate(weights)]
    nodes[0].inputs.update(enumerate(xs))
    wire: dict[tuple[str, int, int], np.ndarray] = {}  # (kind, link, micro): the message
    for s, action in sch.simulate(stage_lists(schedule, stages, micro)).trace:
        node, i = nodes[s], action.micro
        match action.kind:
            case sch.FORWARD:
                node.forward(i)
            case sch.BACKWARD:
                node.backward(i)
            case sch.SEND_ACTIVATION:
                wire["a", s, i] = node.outputs[i]
            case sch.RECV_ACTIVATION:
                node.inputs[i] = wire.pop(("a", s - 1, i))
            case sch.SEND_GRADIENT:
                wire["g", s - 1, i] = node.in_grads.pop(i)
            case sch.RECV_GRADIENT:
                node.out_grads[i] = wire.pop(("g", s, i))
    assert not wire
    whole = [NumpyStage(w.copy(), False, ys) for w in weights]
    for i, x in enumerate(xs):  # the unsplit network, one micro-batch after another
        for node in whole:
            node.inputs[i] = x
            node.forward(i)
            x = node.outputs[i]
        g = 2 * (x - ys[i])
        for node in reversed(whole):
            node.out_grads[i] = g
            node.backward(i)
            g = node.in_grads.pop(i)
    for split, unsplit in zip(nodes, whole, strict=True):
        np.testing.assert_allclose(split.grad, unsplit.grad, rtol=1e-12, atol=1e-12)
