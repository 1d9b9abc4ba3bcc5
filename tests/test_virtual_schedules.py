"""The schedules with virtual stages of parallel/planning/virtual_schedules.py (interleaved 1F1B, ZB-V, V-Half), on
2-8 ranks with 1-16 micro-batches: each chunk's forward, backward (B and W) once and in order on the rank that holds
it, every send met by its receive at the same boundary, no deadlock under the strictest rendezvous transport; the
simulator's replay of them (parallel/planning/virtual_sim.py), and the bytes each rank holds
(parallel/planning/virtual_walk.py, parallel/planning/virtual_memory.py). Pure: no process group."""

import dataclasses
import functools
import statistics
from collections import Counter
from dataclasses import replace

import pytest
import torch

from model import BLOCK_CLASSES, GPTConfig, gpt_layers
from parallel.planning import schedules
from parallel.planning.config import AutoRecompute, NoRecompute
from parallel.planning.layout import build_layout
from parallel.planning.memory_model import CPU_RNG_STATE_BYTES
from parallel.planning.partition import partition_layers
from parallel.planning.schedule_walk import in_flight_micro_batches
from parallel.planning.shapes import RunShape, Shape, Target, Topology
from parallel.planning.stage_plan import StagePlan
from parallel.planning.step_sim import StageCosts, simulate_stages
from parallel.planning.virtual_choice import virtual_lines, virtual_options
from parallel.planning.virtual_memory import one_chunk_peaks, virtual_peaks
from parallel.planning.virtual_program import UNIT_SLOTS, VIRTUAL_SCHEDULES, Slots, VirtualProgram
from parallel.planning.virtual_schedules import virtual_schedule
from parallel.planning.virtual_sim import simulate_virtual
from parallel.planning.virtual_slots import MAX_SLOTS, priced_slots
from parallel.planning.virtual_walk import ChunkBytes, RankMoments

KINDS = [("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("interleaved-1f1b", 4), ("zb-v", 2), ("v-half", 2)]
"""Each schedule with the chunks per rank it may run (interleaved 1F1B: the planner's 2 to 4)."""
RANKS = range(2, 9)
MICRO_BATCHES = range(1, 17)


CPU_SLOTS = Slots(3, 2, 1)
"""Programmes laid out as this CPU's measured prices lay them out (parallel/planning/virtual_slots.py)."""


@functools.cache
def programs(
    schedule: str, chunks: int, micro_batches: int, ranks: int, slots: Slots = UNIT_SLOTS
) -> tuple[VirtualProgram, ...] | None:
    """Every rank's programme, or None where the schedule refuses the shape (interleaved-1f1b: Megatron's rounds)."""
    try:
        return tuple(virtual_schedule(schedule, micro_batches, ranks, chunks, slots))
    except ValueError as refused:
        assert schedule == "interleaved-1f1b" and micro_batches > ranks and micro_batches % ranks
        assert "multiple of the pipeline ranks" in str(refused)
        return None


def shapes(schedule: str, chunks: int, ranks: int, slots: Slots = UNIT_SLOTS):
    for m in MICRO_BATCHES:
        if (progs := programs(schedule, chunks, m, ranks, slots)) is not None:
            yield m, progs


@pytest.mark.parametrize("schedule, chunks", KINDS)
def test_early_recompute_runs_right_before_each_backward_of_its_stages_and_moves_nothing_else(schedule, chunks):
    """A stage that recomputes early runs each micro-batch's RecomputeEarly right before that micro-batch's backward
    (B), in its step: the rank then recomputes while the gradient is on its way, and no other instruction or message
    moves, so the deadlock replay above covers these programmes too. The last virtual stage never recomputes early."""
    backward = (schedules.BackwardPass, schedules.BackwardInput)
    for ranks in (2, 4):
        virtual = chunks * ranks
        early = frozenset(range(0, virtual - 1, 2))
        for m, plain in shapes(schedule, chunks, ranks):
            for program, with_early in zip(plain, virtual_schedule(schedule, m, ranks, chunks, early=early)):
                assert len(program.steps) == len(with_early.steps)
                for step, step_early in zip(program.steps, with_early.steps):
                    recomputes = [c for c in step_early if c.kind is schedules.RecomputeEarly]
                    assert [c for c in step_early if c.kind is not schedules.RecomputeEarly] == list(step)
                    for recompute in recomputes:
                        assert recompute.stage in early
                        after = step_early[step_early.index(recompute) + 1]
                        assert after.kind in backward and after.stage == recompute.stage
                        assert after.micro_batch == recompute.micro_batch
                    assert len(recomputes) == sum(c.kind in backward and c.stage in early for c in step)
        with pytest.raises(ValueError, match="last virtual stage"):
            virtual_schedule(schedule, 4, ranks, chunks, early=frozenset({virtual - 1}))


@pytest.mark.parametrize("slots", [UNIT_SLOTS, CPU_SLOTS], ids=Slots.text)
@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("schedule, chunks", KINDS)
def test_every_chunk_runs_each_micro_batch_once_in_order_on_the_rank_that_holds_it(schedule, chunks, ranks, slots):
    split = schedule != "interleaved-1f1b"
    backward = schedules.BackwardInput if split else schedules.BackwardPass
    for m, progs in shapes(schedule, chunks, ranks, slots):
        placement = progs[0].placement
        last = placement.virtual_stages - 1
        for program in progs:
            commands = program.commands()
            position = {(c.kind, c.stage, c.micro_batch): i for i, c in enumerate(commands)}
            counts = Counter((c.kind, c.stage, c.micro_batch) for c in commands)
            assert all(n == 1 for n in counts.values())
            for chunk in range(chunks):
                stage = placement.virtual_stage(program.rank, chunk)
                assert placement.holder(stage) == (program.rank, chunk)
                for micro_batch in range(m):
                    b = position[(backward, stage, micro_batch)]
                    assert position[(schedules.ForwardPass, stage, micro_batch)] < b
                    if split:
                        assert b < position[(schedules.BackwardWeight, stage, micro_batch)]
                    loads = (schedules.LoadMicroBatch, stage, micro_batch) in position
                    assert loads == (stage in (0, last))
            assert [c.kind for c in commands[-3:]] == [
                schedules.ReduceTiedGrads,
                schedules.ReduceGrads,
                schedules.OptimizerStep,
            ]
            assert all(c.chunk == placement.holder(c.stage)[1] for c in commands if c.stage is not None)


PARTNER = {
    schedules.SendActivation: schedules.RecvActivation,
    schedules.RecvActivation: schedules.SendActivation,
    schedules.SendGrad: schedules.RecvGrad,
    schedules.RecvGrad: schedules.SendGrad,
}


def rendezvous_replay(progs: tuple[VirtualProgram, ...]) -> None:
    """Each rank's batches (`p2p_batches`) under the strictest transport: a rank posts its next batch only once
    every operation of its current one has met its counterpart, and an operation meets it only while the peer has
    it posted. Raise on a deadlock, or where a posted operation faces, on the same pair and direction, another
    message than its own (NCCL runs a pair's transfers in order on one stream)."""
    batches = [program.p2p_batches() for program in progs]
    pc, met = [0] * len(progs), [set() for _ in progs]

    def posted(rank: int) -> set:
        return set(batches[rank][pc[rank]]) - met[rank] if pc[rank] < len(batches[rank]) else set()

    while any(pc[r] < len(batches[r]) for r in range(len(progs))):
        progressed = False
        for r in range(len(progs)):
            for op in posted(r):
                facing = {c for c in posted(op.peer) if c.kind is PARTNER[op.kind] and c.peer == r}
                assert {c.message() for c in facing} <= {op.message()}, f"rank {r}'s {op} faces {facing}"
                if facing:
                    (other,) = facing
                    met[r].add(op)
                    met[op.peer].add(other)
                    progressed = True
            for t in range(len(progs)):
                if pc[t] < len(batches[t]) and not posted(t):
                    met[t].clear()
                    pc[t] += 1
                    progressed = True
        if not progressed:
            stuck = {r: sorted(map(str, posted(r))) for r in range(len(progs)) if pc[r] < len(batches[r])}
            raise AssertionError(f"deadlock under rendezvous: ranks blocked at {stuck}")


LAID_OUT = [UNIT_SLOTS, CPU_SLOTS, Slots(4, 3, 1), Slots(2, 2, 1), Slots(1, 2, 1), Slots(4, 4, 1), Slots(1, 4, 4)]
"""Slot layouts as virtual_slots.stage_slots makes them (the cheapest op one slot, the others 1 to 4): the papers'
units, this CPU's measured 3:2:1, the peers' run's 4:3:1, and others that change the V shapes' greedy order."""


@pytest.mark.parametrize("slots", LAID_OUT, ids=Slots.text)
@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("schedule, chunks", KINDS)
def test_every_send_meets_its_receive_at_the_same_boundary_and_nothing_deadlocks(schedule, chunks, ranks, slots):
    for _, progs in shapes(schedule, chunks, ranks, slots):
        for program in progs:
            for index, step in enumerate(program.steps):
                sends = [c for c in step if c.kind in (schedules.SendActivation, schedules.SendGrad)]
                assert len({c.peer for c in sends}) == len(sends), "two messages one way on one pair in a batch"
                for send in sends:
                    received = [c for c in progs[send.peer].steps[index] if c.kind is PARTNER[send.kind]]
                    assert [c.message() for c in received if c.peer == program.rank] == [send.message()]
        rendezvous_replay(progs)


def test_a_round_of_fewer_micro_batches_is_refused_for_interleaved_1f1b_only():
    with pytest.raises(ValueError, match="multiple of the pipeline ranks"):
        virtual_schedule("interleaved-1f1b", 6, 4, 2)
    assert len(virtual_schedule("zb-v", 6, 4)) == 4
    with pytest.raises(ValueError, match="interleaved-1f1b, zb-v, v-half"):
        virtual_schedule("bfs", 4, 4)
    with pytest.raises(ValueError, match="2 chunks"):
        virtual_schedule("zb-v", 4, 4, 3)


def costs(forward: float, send: float = 0.0) -> StageCosts:
    """A backward of two forwards (B one, W one)."""
    return StageCosts(forward, 2 * forward, 0.0, send, send, 0.0, 0.0, 0.0, weight_grad=forward)


@pytest.mark.parametrize("schedule, chunks", KINDS)
@pytest.mark.parametrize("ranks, micro_batches", [(2, 4), (4, 8), (3, 3)])
def test_at_unit_costs_the_simulated_step_is_the_programmes_slots(schedule, chunks, ranks, micro_batches):
    """The simulator replays a programme at the costs it was laid out for in its slots; a transfer that costs
    something only lengthens it. A message is waited for only by the computation that reads it, and a gradient's
    send at the next boundary (parallel/runtime/boundary_links.py), so where interleaved 1F1B's whole backward (two
    slots' work in one step) meets a peer's forward at one boundary, the forward's rank goes on (when the engine
    waited for a boundary's whole batch there, a 2-rank step of 4 micro-batches took longer than its slots)."""
    progs = programs(schedule, chunks, micro_batches, ranks)
    unit = [[costs(1.0)] * chunks] * ranks
    step = simulate_virtual(progs, unit).step_time_s
    assert step == len(progs[0].steps)
    slow = [[costs(1.0, send=0.25)] * chunks] * ranks
    assert simulate_virtual(progs, slow).step_time_s > len(progs[0].steps)
    busy = simulate_virtual(progs, unit).busy_s
    split = schedule != "interleaved-1f1b"
    assert busy == (chunks * micro_batches * (3 if split else 1 + UNIT_SLOTS.of(schedules.BackwardPass)),) * ranks


@pytest.mark.parametrize("schedule, chunks", KINDS)
def test_a_boundarys_post_costs_its_rank_once_per_batch_of_messages(schedule, chunks):
    """StageCosts.exchange (a post's own work, learnt from traced runs): each boundary's batch adds it to the rank's
    BoundaryExchange; the step grows by at least the posts of the rank that waits least, and no more than every
    rank's posts together."""
    progs = programs(schedule, chunks, 4, 2)
    plain = simulate_virtual(progs, [[costs(1.0)] * chunks] * 2)
    posted = simulate_virtual(progs, [[replace(costs(1.0), exchange=0.1)] * chunks] * 2)
    batches = [sum(1 for step in p.steps if any(c.kind in schedules.COMMUNICATION for c in step)) for p in progs]
    for rank, count in enumerate(batches):  # the mean over its batches and the step's final completion
        grown = posted.rank_instruction_s[rank]["BoundaryExchange"] - plain.rank_instruction_s[rank]["BoundaryExchange"]
        assert grown >= 0.1 * count / (count + 1) - 1e-9
    assert min(batches) * 0.1 - 1e-9 <= posted.step_time_s - plain.step_time_s <= sum(batches) * 0.1 + 1e-9


@pytest.mark.parametrize("schedule", ["zb-v", "v-half"])
def test_programmes_laid_out_in_a_devices_slots_take_their_slots_at_its_costs(schedule):
    """Laid out in 3:2:1 slots, a V's programme at a forward of 3, a B of 2 and a W of 1 takes exactly its slots (as
    unit slots at unit costs). At those costs ZB-V's is shorter than its unit-slot programme (its greedy order then
    expects the work each op really takes); V-Half's, whose memory limit leaves it less choice, within a slot of it."""
    ranks, micro_batches = 4, 8
    cpu = [[dataclasses.replace(costs(1.0), forward=3.0, backward=3.0, backward_input=2.0)] * 2] * ranks
    laid_out = simulate_virtual(programs(schedule, 2, micro_batches, ranks, CPU_SLOTS), cpu).step_time_s
    unit = simulate_virtual(programs(schedule, 2, micro_batches, ranks), cpu).step_time_s
    assert laid_out == len(programs(schedule, 2, micro_batches, ranks, CPU_SLOTS)[0].steps)
    assert laid_out < unit if schedule == "zb-v" else laid_out <= unit + 1


def test_measured_prices_set_the_slots_in_the_ratio_of_their_forward_b_and_w():
    """parallel/planning/virtual_slots.py: rounded to whole slots of the cheapest part, at most MAX_SLOTS; unit where a
    part is unpriced."""
    cpu = dataclasses.replace(costs(4.0), backward=12.8, backward_input=8.8, weight_grad=4.0)
    assert priced_slots([cpu, cpu]) == Slots(1, 2, 1)
    assert priced_slots([dataclasses.replace(cpu, forward=12.0)]) == CPU_SLOTS
    assert priced_slots([dataclasses.replace(cpu, forward=100.0)]) == Slots(MAX_SLOTS, 2, 1)
    assert priced_slots([dataclasses.replace(cpu, weight_grad=0.0, backward_input=None)]) == UNIT_SLOTS


@pytest.mark.parametrize("ranks, micro_batches", [(2, 4), (4, 8), (4, 2), (8, 16)])
def test_one_chunk_per_rank_is_1f1b(ranks, micro_batches):
    """interleaved-1f1b with v = 1 holds what DeepSpeed's 1F1B holds and takes its simulated step."""
    progs = virtual_schedule("interleaved-1f1b", micro_batches, ranks, 1)
    for rank, program in enumerate(progs):
        ones = ChunkBytes((1,) * micro_batches, (0,) * micro_batches, 0, 0, 0, 0)
        peak = RankMoments.of(program).peak([ones])
        assert peak.in_flight == (in_flight_micro_batches(micro_batches, ranks, rank),)
    one_f_one_b = simulate_stages([costs(1.0)] * ranks, micro_batches, "1f1b").step_time_s
    assert simulate_virtual(progs, [[costs(1.0)]] * ranks).step_time_s == one_f_one_b


def test_v_shapes_beat_zb_h1_and_interleaving_beats_1f1b_at_equal_work():
    """4 ranks, 8 micro-batches, each rank's work the same: ZB-V's step is shorter than ZB-H1's, interleaved
    1F1B's shorter than 1F1B's, V-Half's no longer than 1F1B's."""
    one = {s: simulate_stages([costs(1.0)] * 4, 8, s).step_time_s for s in ("1f1b", "zb-h1")}
    half = [[costs(0.5)] * 2] * 4
    virtual = {s: simulate_virtual(virtual_schedule(s, 8, 4), half).step_time_s for s in ("interleaved-1f1b", "zb-v")}
    virtual["v-half"] = simulate_virtual(virtual_schedule("v-half", 8, 4), half).step_time_s
    assert virtual["zb-v"] < one["zb-h1"] < one["1f1b"]
    assert virtual["interleaved-1f1b"] < one["1f1b"]
    assert virtual["v-half"] <= one["1f1b"]


@pytest.mark.parametrize("schedule", VIRTUAL_SCHEDULES)
def test_early_recompute_is_priced_as_its_own_instruction_and_never_lengthens_the_step(schedule):
    """Full recompute (the recompute a forward's seconds), 4 ranks, 8 micro-batches, transfers priced: every chunk but
    the last recomputing early runs its recompute as RecomputeEarly (the recompute's seconds; its B without them),
    which starts before the wait for the gradient, so the simulated step is never longer, and where a rank waits for
    gradients (interleaved 1F1B's) shorter."""
    full = [[dataclasses.replace(costs(0.5, send=0.1), recompute=0.5)] * 2] * 4
    plain = simulate_virtual(virtual_schedule(schedule, 8, 4), full)
    programs = virtual_schedule(schedule, 8, 4, early=frozenset(range(7)))
    early = simulate_virtual(programs, full)
    assert early.step_time_s <= plain.step_time_s
    if schedule == "interleaved-1f1b":
        assert early.step_time_s < plain.step_time_s
    for rank, program in enumerate(programs):
        if any(c.kind is schedules.RecomputeEarly for c in program.commands()):
            assert early.rank_instruction_s[rank]["RecomputeEarly"] == pytest.approx(0.5)
            backward = "BackwardPass" if schedule == "interleaved-1f1b" else "BackwardInput"
            assert early.rank_instruction_s[rank][backward] < plain.rank_instruction_s[rank][backward]


@pytest.fixture(scope="module")
def tiny_gpt():
    config = GPTConfig(n_layer=8, n_head=4, n_embd=64, seq_len=32, vocab_size=64, dropout=0.1)
    return gpt_layers(config, seed=0), Shape.of(config, 2), Target("cpu", "fp32")


def test_v_half_plans_at_most_0_6x_the_1f1b_activation_peak_and_zb_v_about_1f1bs(tiny_gpt):
    """Planned bytes on 4 ranks (8 virtual stages of one block each), no recompute: V-Half's largest rank holds
    at most 0.6x what 1F1B's largest holds; ZB-V holds 1F1B's peak (within the received messages it keeps)."""
    recipes, shape, target = tiny_gpt
    assert sum(r.module_class in BLOCK_CLASSES for r in recipes) == 8
    four, eight = partition_layers(recipes, 4, "type:Block"), partition_layers(recipes, 8, "type:Block")
    none4, none8 = [StagePlan()] * 4, [StagePlan()] * 8
    base = max(p.bytes for p in one_chunk_peaks(recipes, four, none4, "1f1b", 8, shape, target))
    v_half = max(p.bytes for p in virtual_peaks(recipes, eight, none8, "v-half", 2, 8, shape, target))
    zb_v = max(p.bytes for p in virtual_peaks(recipes, eight, none8, "zb-v", 2, 8, shape, target))
    assert v_half <= 0.6 * base
    assert zb_v <= 1.05 * base


def test_the_dry_run_prices_every_virtual_schedule_on_the_layouts_ranks(tiny_gpt):
    """Each schedule that takes the run's micro-batches, on 4 ranks x 2 chunks of the layout's model, priced with
    the layout's time model: V-Half holds the least, ZB-V about 1F1B's; `auto` each rank's chunks together."""
    model = GPTConfig(n_layer=8, n_head=4, n_embd=64, seq_len=32, vocab_size=64, dropout=0.1)
    run = RunShape(Topology(4), Target("cpu", "fp32"), micro_batches=8, micro_batch_size=2)
    layout = build_layout(model, NoRecompute(), run, "type:Block", 0)
    options = {o.schedule: o for o in virtual_options(model, NoRecompute(), layout, run)}
    assert set(options) == {"interleaved-1f1b", "zb-v", "v-half"}
    assert all(o.step_time_s > 0 and len(o.activation_bytes) == len(o.state_bytes) == 4 for o in options.values())
    assert max(options["v-half"].activation_bytes) < max(options["zb-v"].activation_bytes)
    lines = virtual_lines(model, NoRecompute(), layout, run)
    assert [line.split()[0] for line in lines[2:]] == ["interleaved-1f1b", "zb-v", "v-half"]
    auto = virtual_lines(model, AutoRecompute(budget_gb=1.0, reserve_gb=0.0), layout, run)  # planned per rank
    assert [line.split()[0] for line in auto[2:]] == ["interleaved-1f1b", "zb-v", "v-half"]
    odd = RunShape(Topology(4), Target("cpu", "fp32"), micro_batches=6, micro_batch_size=2)
    assert "interleaved-1f1b" not in {o.schedule for o in virtual_options(model, NoRecompute(), layout, odd)}


@pytest.mark.parametrize("schedule, chunks", KINDS)
def test_clipping_makes_every_rank_wait_for_the_slowest_before_its_optimizer_step(schedule, chunks):
    """As step_sim's `clip_barrier`: with clipping, each rank's optimizer step starts once the last rank has reached
    its own and takes its own seconds, so the step ends at the latest arrival plus the longest step; without, a rank
    that arrives early steps early. v = 1 takes 1F1B's clipped step."""
    ranks = 4
    progs = programs(schedule, chunks, 8, ranks)
    slow = [[dataclasses.replace(costs(1.0), optimizer=step)] * chunks for step in (0.5, 4.0, 1.0, 0.5)]
    free = simulate_virtual(progs, slow).step_time_s
    clipped = simulate_virtual(progs, slow, clip_barrier=True).step_time_s
    assert clipped > free
    assert simulate_virtual(progs, [[costs(1.0)] * chunks] * ranks, clip_barrier=True).step_time_s == len(
        progs[0].steps
    )
    one = virtual_schedule("interleaved-1f1b", 8, ranks, 1)
    per_rank = [dataclasses.replace(costs(1.0), optimizer=step) for step in (0.5, 4.0, 1.0, 0.5)]
    expected = simulate_stages(per_rank, 8, "1f1b", clip_barrier=True).step_time_s
    assert simulate_virtual(one, [[c] for c in per_rank], clip_barrier=True).step_time_s == expected


@pytest.mark.parametrize("schedule, chunks", KINDS)
def test_each_ranks_instructions_are_timed_as_a_trace_times_them(schedule, chunks):
    """What a traced step's instructions are compared with (summary.json's `prediction`, per rank): a computation
    takes its chunk's seconds (the mean over the rank's chunks: each runs every micro-batch), ReduceGrads and the
    optimizer step the sum of its chunks', and under clipping the optimizer step from reaching it, so the barrier's
    wait is in it; every wait for a peer is in a boundary's post or the last completion (BoundaryExchange) or in a
    computation's wait for the message it reads (ReceiveWait), so on each rank the spans add up to its whole step."""
    ranks, micro_batches = 4, 8
    progs = programs(schedule, chunks, micro_batches, ranks)
    per_chunk = [
        [
            dataclasses.replace(costs(1.0 + 0.5 * chunk, send=0.1), reduce_grads=0.2, optimizer=0.3 * (rank + 1))
            for chunk in range(chunks)
        ]
        for rank in range(ranks)
    ]
    free = simulate_virtual(progs, per_chunk)
    clipped = simulate_virtual(progs, per_chunk, clip_barrier=True)
    backward = "BackwardPass" if schedule == "interleaved-1f1b" else "BackwardInput"
    ends = []
    for rank, (mine, seconds) in enumerate(zip(per_chunk, free.rank_instruction_s)):
        assert seconds["ForwardPass"] == pytest.approx(statistics.fmean(c.forward for c in mine))
        assert seconds[backward] == pytest.approx(statistics.fmean(c.by_instruction()[backward] for c in mine))
        assert seconds["ReduceGrads"] == pytest.approx(0.2 * chunks)
        assert seconds["OptimizerStep"] == pytest.approx(sum(c.optimizer for c in mine))
        program, total = progs[rank], 0.0
        for step in program.steps:
            for command in step:
                if command.kind not in schedules.COMMUNICATION:
                    total += seconds[command.name]
                    total += seconds["ReceiveWait"] if program.message_read(command) else 0.0
        posts = 1 + sum(1 for step in program.steps if any(c.kind in schedules.COMMUNICATION for c in step))
        ends.append(total + posts * seconds["BoundaryExchange"])
    assert max(ends) == pytest.approx(free.step_time_s)
    slowest = max(sum(c.optimizer for c in mine) for mine in per_chunk)
    assert all(
        s["OptimizerStep"] >= f["OptimizerStep"] for s, f in zip(clipped.rank_instruction_s, free.rank_instruction_s)
    )
    assert max(s["OptimizerStep"] for s in clipped.rank_instruction_s) >= slowest


def test_the_planner_counts_the_cpu_generators_state_each_checkpoint_keeps():
    """memory_model.checkpoint_rng_bytes: torch's non-reentrant checkpoint keeps torch.get_rng_state() per call."""
    assert torch.get_rng_state().untyped_storage().nbytes() == CPU_RNG_STATE_BYTES
