"""Pipeline schedules as action lists, written once for every framework: what one stage does.

A stage ``s`` of ``P`` runs ``m`` micro-batches through its layers. :func:`actions` gives its
ordered list of :class:`Action` s: the forward and backward passes of each micro-batch and the
messages they imply. A stage after the first receives the micro-batch's activation before its
forward pass; a stage before the last sends its output after it, and receives the gradient of
that output before the backward pass; a stage after the first sends the gradient of its input after
its backward pass.

- ``gpipe``: every forward pass, then every backward pass (in reverse order, as GPipe's recompute
  does; any order gives the same gradients). It holds all ``m`` micro-batches' activations.
- ``1f1b``: PipeDream-Flush. ``min(P - s - 1, m)`` forward passes to fill the pipeline, then one
  forward and one backward in turn, then the remaining backward passes. At most ``P - s``
  micro-batches are in flight on stage ``s``. The bubble is GPipe's, ``(P - 1) / (m + P - 1)``.

Messages are rendezvous: a send returns when its receiver took it (Horovod's collectives in a
two-rank process set are). So every link between neighbours must see the same messages in the
same order from both ends, and no cycle of stages may wait on each other. The downstream stage
fixes the order on each link (its receive comes just before the forward pass that needs it, its
send just after the backward pass that made it); the upstream stage places its messages to that
order, sending as early and receiving as late as the order allows (:func:`_merge`). The tests run
every stage's list with blocking messages (:func:`simulate`) and see it complete.

The PyTorch engine runs ``torch.distributed.pipelining``'s own schedules, whose sends do not wait
for their receiver: :func:`unblocked_actions` gives their order and :func:`simulate_unblocked`
runs it, for the planner to price.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

ORDERED = ("gpipe", "1f1b")
"""The schedules given as action lists here (the TensorFlow engine runs them; the names are
:data:`hvdtrain.pipeline.schedules.SCHEDULES`' of the same schedules)."""

FORWARD, BACKWARD = "forward", "backward"
RECV_ACTIVATION, SEND_ACTIVATION = "recv_activation", "send_activation"
RECV_GRADIENT, SEND_GRADIENT = "recv_gradient", "send_gradient"
COMPUTE = (FORWARD, BACKWARD)


@dataclass(frozen=True)
class Action:
    """One thing a stage does: ``kind`` (forward, backward, or one of the four messages) for
    micro-batch ``micro``. Activations go to the next stage, gradients to the previous one."""

    kind: str
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}({self.micro})"


def compute_order(schedule: str, stage: int, stages: int, micro: int) -> list[Action]:
    """The forward and backward passes of ``stage`` (0-based) of ``stages`` over ``micro``
    micro-batches, in the order ``schedule`` runs them (no messages)."""
    _check(schedule, stage, stages, micro)
    if schedule == "gpipe":
        return ([Action(FORWARD, i) for i in range(micro)]
                + [Action(BACKWARD, i) for i in reversed(range(micro))])
    warmup = min(stages - stage - 1, micro)
    order = [Action(FORWARD, i) for i in range(warmup)]
    for i in range(micro - warmup):  # steady: one forward, then the oldest backward
        order += [Action(FORWARD, warmup + i), Action(BACKWARD, i)]
    order += [Action(BACKWARD, i) for i in range(micro - warmup, micro)]
    return order


def _check(schedule: str, stage: int, stages: int, micro: int) -> None:
    if schedule not in ORDERED:
        raise ValueError(f"schedule {schedule!r} is not one of {', '.join(ORDERED)}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not in 0..{stages - 1}")
    if micro < 0:
        raise ValueError(f"micro-batches must be >= 0, not {micro}")


def _upstream_link(order: Sequence[Action], stage: int) -> list[Action]:
    """``order`` with the messages to and from the previous stage around its passes: receive the
    activation just before a forward pass, send the input's gradient just after a backward one."""
    out: list[Action] = []
    for action in order:
        if stage > 0 and action.kind == FORWARD:
            out.append(Action(RECV_ACTIVATION, action.micro))
        out.append(action)
        if stage > 0 and action.kind == BACKWARD:
            out.append(Action(SEND_GRADIENT, action.micro))
    return out


def _link_seen_from_upstream(downstream: Sequence[Action]) -> list[Action]:
    """The messages of the link that the next stage's order fixes, as the upstream stage does
    them: its received activation is our send, its sent gradient our receive."""
    mirror = {RECV_ACTIVATION: SEND_ACTIVATION, SEND_GRADIENT: RECV_GRADIENT}
    return [Action(mirror[a.kind], a.micro) for a in downstream if a.kind in mirror]


def _merge(own: Sequence[Action], link: Sequence[Action]) -> list[Action]:
    """``own`` (passes and upstream messages) with the downstream ``link`` messages placed in
    their order: a send as soon as its forward pass ran, a receive just before the backward pass
    that needs it (then every message before it on the link goes first)."""
    out: list[Action] = []
    done: set[int] = set()  # micro-batches whose forward pass ran here
    pending = list(link)

    def ready() -> bool:
        return bool(pending) and pending[0].kind == SEND_ACTIVATION and pending[0].micro in done

    def flush(until: Action | None) -> None:
        """Every message up to ``until`` (a receive), then every send whose pass already ran."""
        while until is not None and pending:
            message = pending.pop(0)
            if message.kind == SEND_ACTIVATION and message.micro not in done:
                raise AssertionError(f"link order sends {message} before its forward pass")
            out.append(message)
            if message == until:
                break
        while ready():
            out.append(pending.pop(0))

    for action in own:
        if action.kind == BACKWARD:
            flush(Action(RECV_GRADIENT, action.micro))
        out.append(action)
        if action.kind == FORWARD:
            done.add(action.micro)
            flush(None)
    out += pending
    return out


def actions(schedule: str, stage: int, stages: int, micro: int) -> list[Action]:
    """The ordered actions of ``stage`` of ``stages`` for ``micro`` micro-batches under
    ``schedule`` (``gpipe`` or ``1f1b``): its passes and every message they imply."""
    own = _upstream_link(compute_order(schedule, stage, stages, micro), stage)
    if stage == stages - 1:
        return own
    downstream = _upstream_link(compute_order(schedule, stage + 1, stages, micro), stage + 1)
    return _merge(own, _link_seen_from_upstream(downstream))


def unblocked_actions(schedule: str, stage: int, stages: int, micro: int) -> list[Action]:
    """The actions of ``stage`` as ``torch.distributed.pipelining``'s ``ScheduleGPipe`` and
    ``Schedule1F1B`` order them, each message beside its pass (their sends do not wait for the
    receiver: :func:`simulate_unblocked` runs the lists). GPipe: every forward pass, then every
    backward pass in micro-batch order. 1F1B: ``min(P - s, m)`` forward passes, one more than
    :func:`compute_order`'s, then one backward and one forward in turn, then the rest."""
    _check(schedule, stage, stages, micro)
    if schedule == "gpipe":
        order = [Action(FORWARD, i) for i in range(micro)] + [Action(BACKWARD, i)
                                                               for i in range(micro)]
    else:
        warmup = min(stages - stage, micro)
        order = [Action(FORWARD, i) for i in range(warmup)]
        for i in range(micro - warmup):
            order += [Action(BACKWARD, i), Action(FORWARD, warmup + i)]
        order += [Action(BACKWARD, i) for i in range(micro - warmup, micro)]
    own = _upstream_link(order, stage)
    if stage == stages - 1:
        return own
    out: list[Action] = []  # the downstream link's messages beside the passes, unordered by it
    for action in own:
        if action.kind == BACKWARD:
            out.append(Action(RECV_GRADIENT, action.micro))
        out.append(action)
        if action.kind == FORWARD:
            out.append(Action(SEND_ACTIVATION, action.micro))
    return out


def in_flight(order: Sequence[Action]) -> int:
    """The most micro-batches whose forward pass ran and backward pass did not, at any point of
    ``order``: the activations a stage holds at its peak."""
    held, peak = 0, 0
    for action in order:
        held += {FORWARD: 1, BACKWARD: -1}.get(action.kind, 0)
        peak = max(peak, held)
    return peak


@dataclass(frozen=True)
class Timeline:
    """A simulated run of every stage's actions: when each stage finished, how long it
    computed, and every ``(stage, action)`` in an order that the run could have taken."""

    finish: list[float]
    busy: list[float]
    trace: list[tuple[int, Action]]

    @property
    def bubble(self) -> float:
        """The idle share of the stages' time up to the last one's finish."""
        span = max(self.finish)
        return 1.0 - sum(self.busy) / (span * len(self.busy)) if span else 0.0


def simulate(lists: Sequence[Sequence[Action]], forward_s: float = 1.0,
             backward_s: float = 1.0) -> Timeline:
    """Runs every stage's actions with blocking (rendezvous) messages that take no time and
    passes of fixed cost; raises ``RuntimeError`` naming the stuck actions on a deadlock, and when
    a message does not match its neighbour's (another kind or micro-batch)."""
    clock = [0.0] * len(lists)
    busy = [0.0] * len(lists)
    trace: list[tuple[int, Action]] = []
    cost = {FORWARD: forward_s, BACKWARD: backward_s}
    peer = {SEND_ACTIVATION: (1, RECV_ACTIVATION), RECV_ACTIVATION: (-1, SEND_ACTIVATION),
            SEND_GRADIENT: (-1, RECV_GRADIENT), RECV_GRADIENT: (1, SEND_GRADIENT)}

    def step(s: int, action: Action, pos: list[int]) -> bool:
        if action.kind in cost:
            clock[s] += cost[action.kind]
            busy[s] += cost[action.kind]
            trace.append((s, action))
            return True
        other = _neighbour(lists, s, action, peer[action.kind][0])
        theirs = lists[other][pos[other]] if pos[other] < len(lists[other]) else None
        if theirs is None or theirs.kind in cost or peer[theirs.kind][0] != s - other:
            return False  # the neighbour computes, has finished, or waits on its other link
        if theirs != Action(peer[action.kind][1], action.micro):
            raise RuntimeError(f"stage {s} {action} meets stage {other} {theirs}")
        clock[s] = clock[other] = max(clock[s], clock[other])
        pair = [(s, action), (other, theirs)]  # the send first: the receive takes its value
        trace.extend(pair if action.kind in (SEND_ACTIVATION, SEND_GRADIENT) else pair[::-1])
        pos[other] += 1
        return True

    _drive(lists, step)
    return Timeline(clock, busy, trace)


def simulate_unblocked(lists: Sequence[Sequence[Action]], forward_s: float, backward_s: float,
                       transfer_s: float) -> Timeline:
    """Runs every stage's actions as ``torch.distributed.pipelining`` does: a send returns at
    once (``isend``) and its message arrives ``transfer_s`` after it left, messages from one stage
    to a neighbour leaving one after another (each direction of a link carries one at a time); a
    receive waits for its message. Raises ``RuntimeError`` on a deadlock and when a message does
    not match what its receiver expects."""
    clock = [0.0] * len(lists)
    busy = [0.0] * len(lists)
    trace: list[tuple[int, Action]] = []
    cost = {FORWARD: forward_s, BACKWARD: backward_s}
    sent_to = {SEND_ACTIVATION: 1, SEND_GRADIENT: -1}
    from_peer = {RECV_ACTIVATION: (-1, SEND_ACTIVATION), RECV_GRADIENT: (1, SEND_GRADIENT)}
    flying: dict[tuple[int, int], list[tuple[Action, float]]] = {}  # (from, to): (sent, arrival)
    free: dict[tuple[int, int], float] = {}  # when each direction of a link is next free

    def step(s: int, action: Action, pos: list[int]) -> bool:
        if action.kind in cost:
            clock[s] += cost[action.kind]
            busy[s] += cost[action.kind]
        elif action.kind in sent_to:
            link = (s, _neighbour(lists, s, action, sent_to[action.kind]))
            free[link] = max(clock[s], free.get(link, 0.0)) + transfer_s
            flying.setdefault(link, []).append((action, free[link]))
        else:
            offset, expected = from_peer[action.kind]
            queue = flying.get((s + offset, s))
            if not queue:
                return False  # not sent yet
            message, arrival = queue.pop(0)
            if message != Action(expected, action.micro):
                raise RuntimeError(f"stage {s} {action} receives stage {s + offset} {message}")
            clock[s] = max(clock[s], arrival)
        trace.append((s, action))
        return True

    _drive(lists, step)
    return Timeline(clock, busy, trace)


def _neighbour(lists: Sequence[Sequence[Action]], stage: int, action: Action, offset: int) -> int:
    """The stage ``offset`` from ``stage`` that ``action`` talks to; raises where there is none."""
    other = stage + offset
    if not 0 <= other < len(lists):
        raise RuntimeError(f"stage {stage}: {action} has no neighbour")
    return other


def _drive(lists: Sequence[Sequence[Action]],
           step: Callable[[int, Action, list[int]], bool]) -> None:
    """Moves every stage along its list: ``step(stage, action, positions)`` does the action and
    says whether it could (a rendezvous moves its neighbour's position on too); raises when no
    stage can move."""
    pos = [0] * len(lists)
    while any(p < len(a) for p, a in zip(pos, lists, strict=True)):
        moved = False
        for s, todo in enumerate(lists):
            while pos[s] < len(todo) and step(s, todo[pos[s]], pos):
                pos[s] += 1
                moved = True
        if not moved:
            raise _deadlock(lists, pos)


def _deadlock(lists: Sequence[Sequence[Action]], pos: Sequence[int]) -> RuntimeError:
    """The error naming each stage's stuck action."""
    stuck = [f"stage {s}: {a[p]}" for s, (p, a) in enumerate(zip(pos, lists, strict=True))
             if p < len(a)]
    return RuntimeError("deadlock: " + "; ".join(stuck))


def bubble(stages: int, micro: int) -> float:
    """The bubble fraction of GPipe and 1F1B with balanced stages: ``(P - 1) / (m + P - 1)``."""
    return (stages - 1) / (micro + stages - 1)
