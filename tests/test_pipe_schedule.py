"""The training schedules of parallel/planning/schedules.py, checked instruction by instruction on every stage of 1, 2
and 4 stages with 1..8 micro-batches: each micro-batch's forward, B and W once and in order, W's deferred within
ZB-H1's bound, early recompute right before its RecvGrad, pipe buffers never shared while live, DeepSpeed's
communication order kept (a forward's output sent first in its step), no deadlock under the strictest transport
(every send and receive blocking until its peer's matching operation is posted, as NCCL's large messages do) for
the batches the engine posts, whatever each stage plans, nor under the engine's posted sends (the step-time
simulator); and the activation peak parallel/planning/schedule_walk.py reads off each schedule."""

import itertools
from collections import Counter
from dataclasses import replace

import pytest
from deepspeed.runtime.pipe.schedule import TrainSchedule

from parallel.planning.schedule_walk import activation_peak
from parallel.planning.schedules import (
    SCHEDULES,
    RecvGrad,
    SendActivation,
    StageProgram,
    grad_sends_released,
    one_f_one_b,
    p2p_batches,
    train_schedule,
)
from parallel.planning.step_sim import PER_STEP, simulate
from tests.shared_runs import EngineRun

ENGINE_RUNS = {"large-messages": EngineRun("large_message_runs", {}, nproc=2)}

SHAPES = [(stages, micro_batches) for stages in (1, 2, 4) for micro_batches in range(1, 9)]
COMBINATIONS = list(itertools.product(SCHEDULES, (False, True)))
COMMUNICATION = ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "ReduceTiedGrads")
BACKWARD = {"1f1b": "BackwardPass", "zb-h1": "BackwardInput"}


def communication(kind: str, early: bool, micro_batches: int, stages: int, stage: int) -> list[str]:
    """DeepSpeed's own communication order, except where a stagecheck schedule (zb-h1, or early recompute) sends:
    it moves each step's SendActivation to the front of the step (its engine sends asynchronously)."""
    ours = kind != "1f1b" or early
    steps = [[type(c).__name__ for c in commands] for commands in TrainSchedule(micro_batches, stages, stage).steps()]
    out = []
    for names in steps:
        if ours:
            names = [n for n in names if n == "SendActivation"] + [n for n in names if n != "SendActivation"]
        out += [n for n in names if n in COMMUNICATION]
    return out


def flat(program: StageProgram) -> list[tuple[str, int | None, int | None]]:
    """(name, micro-batch, buffer id) of every instruction in order; the k-th of a kind is micro-batch k."""
    seen: Counter[str] = Counter()
    out = []
    for command in program.commands():
        name = type(command).__name__
        out.append((name, None if name in PER_STEP else seen[name], getattr(command, "buffer_id", None)))
        seen[name] += 1
    return out


@pytest.mark.parametrize("kind, early", COMBINATIONS)
@pytest.mark.parametrize("stages, micro_batches", SHAPES)
def test_every_micro_batch_runs_forward_b_and_w_once_in_order(kind, early, stages, micro_batches):
    backward = BACKWARD[kind]
    for stage in range(stages):
        program = flat(train_schedule(kind, early, micro_batches, stages, stage))
        position = {(name, m): i for i, (name, m, _) in enumerate(program)}
        names = Counter(name for name, _, _ in program)
        assert names["ForwardPass"] == names[backward] == micro_batches
        assert names["BackwardWeight"] == (micro_batches if kind == "zb-h1" else 0)
        assert names["BackwardPass" if kind == "zb-h1" else "BackwardInput"] == 0
        assert [name for name, _, _ in program[-3:]] == list(PER_STEP)
        for m in range(micro_batches):
            assert position[("ForwardPass", m)] < position[(backward, m)]
            if kind == "zb-h1":
                assert position[(backward, m)] < position[("BackwardWeight", m)] < position[("ReduceTiedGrads", None)]


@pytest.mark.parametrize("kind, early", COMBINATIONS)
@pytest.mark.parametrize("stages, micro_batches", SHAPES)
def test_early_recompute_sits_right_before_the_recv_grad_of_its_buffer(kind, early, stages, micro_batches):
    for stage in range(stages):
        program = flat(train_schedule(kind, early, micro_batches, stages, stage))
        early_here = early and stage < stages - 1
        recomputes = [i for i, (name, _, _) in enumerate(program) if name == "RecomputeEarly"]
        assert len(recomputes) == (micro_batches if early_here else 0)
        for i in recomputes:
            (_, m, buffer), (next_name, next_m, next_buffer) = program[i], program[i + 1]
            assert (next_name, next_m, next_buffer) == ("RecvGrad", m, buffer)


@pytest.mark.parametrize("kind, early", COMBINATIONS)
@pytest.mark.parametrize("stages, micro_batches", SHAPES)
def test_a_pipe_buffer_is_never_reused_while_its_micro_batch_is_live(kind, early, stages, micro_batches):
    for stage in range(stages):
        schedule = train_schedule(kind, early, micro_batches, stages, stage)
        # W reads the weight-gradient store, not the buffer: its buffer id is a label for the trace.
        program = [
            (i, m, b) for i, (name, m, b) in enumerate(flat(schedule)) if b is not None and name != "BackwardWeight"
        ]
        assert all(0 <= b < schedule.pipe_buffers for _, _, b in program)
        spans = {}
        for i, m, b in program:
            first, _, _ = spans.get(m, (i, i, b))
            assert spans.get(m, (i, i, b))[2] == b, f"micro-batch {m} moved buffer"
            spans[m] = (first, i, b)
        for (m1, (start1, end1, b1)), (m2, (start2, end2, b2)) in itertools.combinations(spans.items(), 2):
            assert b1 != b2 or end1 < start2 or end2 < start1, f"stage {stage}: micro-batches {m1} and {m2} share {b1}"


@pytest.mark.parametrize("kind, early", COMBINATIONS)
@pytest.mark.parametrize("stages, micro_batches", SHAPES)
def test_communication_is_deepspeeds_own_order_with_activations_sent_first(kind, early, stages, micro_batches):
    """Only local instructions are added, and a forward's output is sent at the start of its step; with
    asynchronous sends that cannot deadlock (the simulator replays every shape)."""
    for stage in range(stages):
        ours = [n for n, _, _ in flat(train_schedule(kind, early, micro_batches, stages, stage)) if n in COMMUNICATION]
        assert ours == communication(kind, early, micro_batches, stages, stage)
    simulate(micro_batches, stages, unit_costs(0.5, early, stages), kind, early)


PARTNER = {
    "SendActivation": ("RecvActivation", 1),
    "RecvActivation": ("SendActivation", -1),
    "SendGrad": ("RecvGrad", -1),
    "RecvGrad": ("SendGrad", 1),
}
"""Each point-to-point instruction's counterpart, and on which neighbour (+1: the next stage)."""


def rendezvous_replay(programs: list[StageProgram]) -> None:
    """Run the stages' point-to-point batches (`p2p_batches`, what the engine posts) under the strictest transport:
    a stage posts its next batch only once every operation of its current one has met its counterpart, and an
    operation meets it only while the peer has it posted (NCCL once a message outgrows its buffers: a send holds
    the pair's one stream until the peer receives). Raise on a deadlock, or where a stage's posted operation faces
    its counterpart kind for another micro-batch (the k-th of a kind is micro-batch k)."""
    stages = len(programs)
    batches = []
    for program in programs:
        seen: Counter[str] = Counter()
        named = []
        for batch in p2p_batches(program):
            named.append({(type(c).__name__, seen[type(c).__name__]) for c in batch})
            seen.update(type(c).__name__ for c in batch)
        batches.append(named)
    pc, met = [0] * stages, [set() for _ in range(stages)]

    def posted(stage: int) -> set:
        return batches[stage][pc[stage]] - met[stage] if pc[stage] < len(batches[stage]) else set()

    while any(pc[s] < len(batches[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            for name, m in posted(s):
                partner, side = PARTNER[name]
                facing = {op for op in posted(s + side) if op[0] == partner}
                assert facing <= {(partner, m)}, f"stage {s}'s {name} {m} faces stage {s + side}'s {facing}"
                if facing:
                    met[s].add((name, m))
                    met[s + side].add((partner, m))
                    progressed = True
            for t in range(stages):
                if pc[t] < len(batches[t]) and not posted(t):
                    met[t].clear()
                    pc[t] += 1
                    progressed = True
        if not progressed:
            stuck = {s: sorted(posted(s)) for s in range(stages) if pc[s] < len(batches[s])}
            raise AssertionError(f"deadlock under rendezvous: stages blocked at {stuck}")


EARLY_PATTERNS = {
    "none": lambda stages: [False] * stages,
    "all": lambda stages: [True] * stages,
    "first": lambda stages: [s == 0 for s in range(stages)],
    "alternate": lambda stages: [s % 2 == 1 for s in range(stages)],
}
"""Per-stage early settings: a layout's stage plans choose them one by one."""


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("pattern", EARLY_PATTERNS)
@pytest.mark.parametrize("stages, micro_batches", SHAPES + [(3, 5), (8, 8), (8, 3)])
def test_every_send_meets_its_receive_under_rendezvous_whatever_each_stage_plans(kind, pattern, stages, micro_batches):
    """What keeps NCCL from deadlocking: every send has its receive posted in the same batch or earlier on the
    peer, for every schedule, stage count, micro-batch count, deferral, and mix of stage plans with and without
    early recompute."""
    early = EARLY_PATTERNS[pattern](stages)
    for deferred in [None, *range(stages)] if kind == "zb-h1" else [None]:
        rendezvous_replay([train_schedule(kind, early[s], micro_batches, stages, s, deferred) for s in range(stages)])


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("pattern", EARLY_PATTERNS)
@pytest.mark.parametrize("stages, micro_batches", SHAPES + [(3, 5), (8, 8), (8, 3)])
def test_a_gradient_send_is_released_only_once_its_receive_is_posted(kind, pattern, stages, micro_batches):
    """The interpreter waits for a posted SendGrad (and drops its tensor) once the stage has received activation k,
    for the gradients `grad_sends_released` names: the previous stage must have posted their RecvGrad no later than
    the batch that sent activation k, whatever its plan, so the wait needs nothing more from either side."""
    early = EARLY_PATTERNS[pattern](stages)
    for deferred in [None, *range(stages)] if kind == "zb-h1" else [None]:
        for stage in range(1, stages):
            previous = train_schedule(kind, early[stage - 1], micro_batches, stages, stage - 1, deferred)
            posted_recvs, posted_before_send = 0, []
            for batch in p2p_batches(previous):
                posted_recvs += sum(isinstance(c, RecvGrad) for c in batch)
                posted_before_send += [posted_recvs] * sum(isinstance(c, SendActivation) for c in batch)
            released = grad_sends_released(micro_batches, stages, stage)
            assert len(released) == micro_batches
            assert all(r <= p for r, p in zip(released, posted_before_send)), (stage, released, posted_before_send)


def test_sending_activations_first_needs_the_recv_grad_in_the_same_batch():
    """Stage 0 sends its activation first, before the early recompute and its RecvGrad; stage 1 sends its gradient
    before it receives that activation (DeepSpeed's order). Posted one by one, each send would wait on a receive
    queued behind the peer's send; posted as one batch with the RecvGrad, both meet."""
    programs = [train_schedule("1f1b", True, 4, 2, stage) for stage in range(2)]
    names = [type(c).__name__ for c in programs[0].commands()]
    first_recv = names.index("RecvGrad")
    assert names[first_recv - 2 : first_recv + 1] == ["SendActivation", "RecomputeEarly", "RecvGrad"]
    assert [type(c).__name__ for c in p2p_batches(programs[0])[1]] == ["SendActivation", "RecvGrad"]
    rendezvous_replay(programs)
    one_per_step = [replace(p, steps=tuple((c,) for c in p.commands())) for p in programs]
    with pytest.raises(AssertionError, match="deadlock"):
        rendezvous_replay(one_per_step)


@pytest.mark.multiproc
def test_messages_above_16_mib_train_both_schedules_alike_on_gloo(engine_runs):
    """A real 2-stage run whose every activation and gradient message is 17 MiB: zb-h1 with early recompute, its
    SendActivation and RecvGrad posted as one batch, trains as DeepSpeed's own 1F1B does, bit for bit."""
    ranks = engine_runs["large-messages"]
    for rank in ranks:
        assert all(run["received_bytes"] > 16 * 2**20 for run in rank.values())
        assert rank["zb-h1/full/early"]["loss"] == rank["1f1b"]["loss"]
        assert rank["zb-h1/full/early"]["digest"] == rank["1f1b"]["digest"]


@pytest.mark.parametrize("stages, micro_batches", SHAPES)
def test_zb_h1_defers_at_most_the_stage_index_and_stays_within_1f1b_micro_batches(stages, micro_batches):
    """ZB-H1's bound: at every forward, stage s has at most s micro-batches B'd but not W'd, and those plus the
    micro-batches it holds whole never outnumber what stage 0 holds under 1F1B."""
    for stage in range(stages):
        live = pending = 0
        for name, _, _ in flat(train_schedule("zb-h1", False, micro_batches, stages, stage)):
            live += {"ForwardPass": 1, "BackwardInput": -1}.get(name, 0)
            pending += {"BackwardInput": 1, "BackwardWeight": -1}.get(name, 0)
            if name == "ForwardPass":
                assert pending <= stage and live + pending <= min(stages, micro_batches)


@pytest.mark.parametrize("early", (False, True))
@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (4, 8), (4, 3), (3, 6)])
def test_a_planner_chosen_deferral_is_kept_and_every_w_still_runs_in_order(early, stages, micro_batches):
    """Any deferral the layout picks (0 up to the stage count): W's once each in micro-batch order, never more
    pending at a forward, DeepSpeed's communication order, and no deadlock with it on every stage."""
    for deferred in range(stages):
        for stage in range(stages):
            program = flat(train_schedule("zb-h1", early, micro_batches, stages, stage, deferred))
            assert [m for name, m, _ in program if name == "BackwardWeight"] == list(range(micro_batches))
            pending = most = 0
            for name, _, _ in program:
                pending += {"BackwardInput": 1, "BackwardWeight": -1}.get(name, 0)
                most = max(most, pending) if name == "ForwardPass" else most
            assert most <= deferred
            ours = [n for n, _, _ in program if n in COMMUNICATION]
            assert ours == communication("zb-h1", early, micro_batches, stages, stage)
        simulate(micro_batches, stages, unit_costs(0.5, early, stages), "zb-h1", early, [deferred] * stages)


@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (4, 8)])
def test_without_deferral_w_follows_its_b_and_with_it_the_last_gradient_goes_first(stages, micro_batches):
    for stage in range(stages):
        program = [(name, m) for name, m, _ in flat(train_schedule("zb-h1", False, micro_batches, stages, stage, 0))]
        last = stage == stages - 1
        for i, (name, m) in enumerate(program):
            if name == "BackwardInput":  # 1F1B's backward cut in two; the last stage sends the gradient first
                assert program[i + 1 : i + 2 + last] == [("SendGrad", m)] * last + [("BackwardWeight", m)]
        if stage > 0:  # the default defers: after the last B nothing is left for the previous stage but its gradient
            program = [(name, m) for name, m, _ in flat(train_schedule("zb-h1", False, micro_batches, stages, stage))]
            last_b = program.index(("BackwardInput", micro_batches - 1))
            assert program[last_b + 1] == ("SendGrad", micro_batches - 1)
            assert all(name == "BackwardWeight" for name, _ in program[last_b + 2 : -3])


def unit_costs(recompute: float, early: bool, stages: int):
    """Forward 1, backward 2 (B 1 + W 1), plus the plan's recompute: inside the backward, or early on every
    stage but the last; free transfers."""

    def cost(ins) -> float:
        inside = 0.0 if early and ins.stage < stages - 1 else recompute
        return {
            "ForwardPass": 1.0,
            "BackwardPass": 2.0 + inside,
            "BackwardInput": 1.0 + inside,
            "BackwardWeight": 1.0,
            "RecomputeEarly": recompute,
        }.get(ins.name, 0.0)

    return cost


@pytest.mark.parametrize("kind, early", COMBINATIONS)
@pytest.mark.parametrize("stages, micro_batches", SHAPES)
def test_no_schedule_deadlocks_under_rendezvous_sends(kind, early, stages, micro_batches):
    timeline = simulate(micro_batches, stages, unit_costs(0.5, early, stages), kind, early)
    for stage in range(stages):
        ran = [i.instruction.name for i in timeline.of_stage(stage)]
        assert ran == [n for n, _, _ in flat(train_schedule(kind, early, micro_batches, stages, stage))]


@pytest.mark.parametrize("kind", SCHEDULES)
def test_early_recompute_hides_in_the_wait_for_the_gradient(kind):
    late, early = (simulate(8, 4, unit_costs(0.5, e, 4), kind, e).step_time_s for e in (False, True))
    assert early < late


def test_1f1b_without_early_is_deepspeeds_schedule_and_unknown_kinds_are_refused():
    # one_f_one_b is DeepSpeed's TrainSchedule instruction for instruction: tests/test_schedules_match_deepspeed.py
    assert train_schedule("1f1b", False, 4, 2, 0) == one_f_one_b(4, 2, 0)
    with pytest.raises(ValueError, match="1f1b, zb-h1"):
        train_schedule("gpipe", False, 4, 2, 0)


def peak(kind, early, kept, pending, recomputed, micro_batches=8, stages=4, stage=0, deferred=None):
    m = micro_batches
    return activation_peak(kind, early, [kept] * m, pending, [recomputed] * m, m, stages, stage, deferred)


@pytest.mark.parametrize("stage", range(4))
def test_the_1f1b_peak_is_the_micro_batches_in_flight_and_early_adds_one_recomputed(stage):
    plain = peak("1f1b", False, 10, 0, 0, stage=stage)
    assert (plain.bytes, plain.in_flight, plain.recomputed) == (10 * (4 - stage), 4 - stage, 0)
    early = peak("1f1b", True, 10, 0, 7, stage=stage)
    if stage < 3:  # from RecomputeEarly to its B, with every micro-batch in flight still held
        assert (early.bytes, early.in_flight, early.recomputed) == (10 * (4 - stage) + 7, 4 - stage, 1)
    else:  # the last stage never recomputes early
        assert early == plain


@pytest.mark.parametrize("stage", range(4))
def test_zb_h1_holds_its_deferred_ws_on_top_of_1f1bs_micro_batches(stage):
    """W-pending micro-batches hold 3 bytes each: stage s defers s of them at its forwards; the last B's
    gradient goes first, so the last stage briefly holds its 3 deferred W's and the last B's."""
    zb = peak("zb-h1", False, 10, 3, 0, stage=stage)
    expected = max(10 * (4 - stage) + 3 * stage, 3 * (stage + 1) if stage else 0)
    assert (zb.bytes, zb.in_flight, zb.weights_pending) == (expected, 4 - stage, stage)
    assert peak("zb-h1", False, 10, 3, 0, stage=stage, deferred=0) == peak("1f1b", False, 10, 0, 0, stage=stage)


def test_a_micro_batch_kept_whole_counts_only_while_it_is_in_flight():
    """Per-micro-batch bytes (recompute for some micro-batches only): the peak is the heaviest window."""
    kept = [5, 1, 1, 5, 1, 1, 5, 1]
    assert activation_peak("1f1b", False, kept, 0, [0] * 8, 8, 4, 0).bytes == 5 + 1 + 1 + 5
    assert activation_peak("1f1b", False, kept, 0, [0] * 8, 8, 4, 2).bytes == 5 + 1
