"""One answer to "does it fit, and how fast": the GPU figures and the uniform modes priced under the layout's own
schedule, `balanced` never slower than DeepSpeed's splits, and the dry run's per-stage verdict with the change that
helps most and the bubble advice. In process: the planner is pure."""

from model import GPTConfig
from parallel.planning.config import AutoRecompute, FullRecompute, NoRecompute
from parallel.planning.instruction_seconds import analytic_rates
from parallel.planning.layout import build_layout
from parallel.planning.plan_verdict import Replanner, verdict_lines
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import GIB, RunShape, Target, Topology
from parallel.planning.virtual_layout import virtual_layout, virtual_plan, virtual_shape, with_virtual_plan

MODEL = GPTConfig(n_layer=8, n_head=4, n_embd=128, seq_len=128, vocab_size=256, dropout=0.1)
CUDA = RunShape(Topology(2), Target("cuda", "bf16"), micro_batches=4, micro_batch_size=2)


def planned(recompute, run=CUDA, schedule="1f1b", partition="type:Block", model=MODEL):
    layout = build_layout(model, recompute, run, partition, 0, schedule=schedule)
    return layout, plan_run(model, recompute, layout, run)


def test_the_gpu_figures_and_the_uniform_modes_run_the_layouts_schedule():
    """A CUDA plan is priced at an H100's rates: its by_gpu H100 figure is the predicted step itself, also under
    zb-h1 with early recompute (it was the 1F1B time), and full's "same stages" figure is the plan's own."""
    full = FullRecompute(interval="stage", early=True)
    layout, plan = planned(full, schedule="zb-h1")
    step = plan.step_time
    assert layout.schedule == "zb-h1" and step.early_stages == (0,)
    assert step.by_gpu["H100"]["step_time_s"] == step.predicted_step_time_s
    one_f_one_b = planned(full)[1].step_time
    assert step.predicted_step_time_s < one_f_one_b.predicted_step_time_s
    # like with like: the uniform modes under zb-h1 with early recompute too
    uniform = planned(FullRecompute(early=True), schedule="zb-h1")[1].step_time.predicted_step_time_s
    assert step.by_mode_s["full"] == uniform
    assert step.by_mode_s["none"] == planned(NoRecompute(), schedule="zb-h1")[1].step_time.predicted_step_time_s


def test_balanced_never_loses_to_a_deepspeed_split():
    """The issue's case: gpt3-13b on 8 stages, where balanced's own block counts simulated slower than DeepSpeed's
    uniform split."""
    model = GPTConfig(n_layer=40, n_head=40, n_embd=5120, seq_len=2048, vocab_size=50257)
    run = RunShape(Topology(8), Target("cuda", "bf16"), micro_batches=4, micro_batch_size=2)
    balanced, plan = planned(FullRecompute(), run, partition="balanced", model=model)
    candidates = dict(balanced.partition_candidates)
    assert set(candidates) >= {"uniform", "parameters", "type:Block"} and len(candidates) == 4
    assert plan.predicted_step_time_s == min(candidates.values())
    for method in ("uniform", "parameters", "type:Block"):
        other = planned(FullRecompute(), run, partition=method, model=model)[1]
        assert plan.predicted_step_time_s <= other.predicted_step_time_s
    assert any(line.startswith("partition balanced: ") for line in balanced.describe())


def verdict(plan, memory_gb: float, recompute, run=CUDA, schedule="1f1b") -> list[str]:
    replanner = Replanner(MODEL, "type:Block", 0, None, analytic_rates(run.target.device, run.target.precision))
    return verdict_lines(plan, int(memory_gb * GIB), "test", replanner, recompute, run, schedule)


def test_every_stage_gets_a_verdict_and_an_overfull_one_the_change_that_helps_most():
    _, plan = planned(NoRecompute())
    peaks = [s.predicted_peak_bytes / GIB for s in plan.stages]
    roomy = verdict(plan, 2 * max(peaks), NoRecompute())
    assert roomy[1:3] == [f"stage {s}: predicted peak {peaks[s]:.3f} GiB: fits" for s in (0, 1)]
    assert not any("helps most" in line for line in roomy)
    tight = (min(peaks) + max(peaks)) / 2 if min(peaks) < max(peaks) else 0.9 * max(peaks)
    lines = verdict(plan, tight, NoRecompute())
    over = [line for line in lines if "over by" in line]
    assert over and all(f"over by {p - tight:.3f} GiB" in line for p, line in zip(sorted(peaks)[-len(over) :], over))
    helps = next(line for line in lines if line.startswith("helps most"))
    # the fastest change that fits: recompute (auto at this memory, or full) rather than none
    assert "recompute" in helps or "parallel." in helps or "train." in helps


def test_an_idle_pipeline_is_told_what_would_fill_it():
    """8 stages, 4 micro-batches: most of every stage's step is bubble."""
    run = RunShape(Topology(8), Target("cuda", "bf16"), micro_batches=4, micro_batch_size=2)
    full = FullRecompute()
    _, plan = planned(full, run)
    lines = verdict(plan, 80, full, run)
    assert any(line.startswith("bubble: the stages idle ") for line in lines)
    faster = next(line for line in lines if "faster: " in line)
    assert "parallel.schedule=zb-h1" in faster
    assert any("train.micro_batches=8: " in line for line in lines)
    auto = AutoRecompute(budget_gb=80, reserve_gb=0, early=False)
    _, plan = planned(auto, run, schedule="1f1b")
    lines = verdict(plan, 80, auto, run, "1f1b")
    assert "parallel.schedule=auto and recompute.early=null" in next(line for line in lines if "faster: " in line)


def test_the_verdict_is_one_line_and_the_helping_change_is_priced_per_token():
    """The issue's case: a half-size micro-batch halves the step and the tokens; the hint compares tokens/s."""
    _, plan = planned(NoRecompute())
    peaks = [s.predicted_peak_bytes / GIB for s in plan.stages]
    roomy = verdict(plan, 2 * max(peaks), NoRecompute())[3]
    assert roomy.startswith(f"verdict: fits: all 2 stages within {2 * max(peaks):.3f} GiB, ")
    lines = verdict(plan, 0.5 * min(peaks), NoRecompute())
    assert f"verdict: does not fit: 2 of 2 stages over {0.5 * min(peaks):.3f} GiB" in lines
    helps = next(line for line in lines if line.startswith("helps most"))
    assert f" tokens/s against {plan.tokens_per_s:,.0f} now)" in helps
    tight = (min(peaks) + max(peaks)) / 2
    replanner = Replanner(MODEL, "type:Block", 0, None, analytic_rates("cuda", "bf16"))
    half = RunShape(Topology(2), CUDA.target, micro_batches=4, micro_batch_size=1)
    peak, step = replanner.plan(NoRecompute(), half, "1f1b")
    assert peak <= tight * GIB and step < plan.predicted_step_time_s  # it fits, and its step looks faster
    chosen = next(line for line in verdict(plan, tight, NoRecompute()) if line.startswith("helps most"))
    per_token = float(chosen.split(" s, ")[1].split(" tokens/s")[0].replace(",", ""))
    assert per_token >= half.tokens_per_step(MODEL.seq_len) / step  # never a smaller batch that is slower per token


def test_the_table_says_where_the_state_bytes_per_parameter_come_from():
    lines = planned(NoRecompute())[1].lines()
    assert "param+grad+opt: 18 bytes per parameter" in next(line for line in lines if line.startswith("param+grad"))
    two = RunShape(Topology(2, 2), Target("cuda", "bf16"), micro_batches=4, micro_batch_size=2)
    legend = next(line for line in planned(NoRecompute(), two)[1].lines() if line.startswith("param+grad"))
    assert "12 BF16_Optimizer's fp32 master weights and two fp32 moments / 2 data-parallel ranks" in legend
    assert "param+grad+opt: 12 bytes per parameter" in legend
    step = next(line for line in planned(NoRecompute())[1].lines() if line.startswith("predicted_step_time_s"))
    assert "1,024 tokens per step, " in step and " tokens/s (" in step


def test_a_virtual_stage_layout_gets_one_verdict_per_rank_its_chunks_together():
    """Under V-Half rank 0 holds the first and the last chunk: the verdict adds its chunks' activation peak and
    states, so a memory below that rank's total is over on that rank, though each virtual stage alone fits."""
    run = RunShape(Topology(2), Target("cuda", "bf16"), micro_batches=4, micro_batch_size=2)
    layout = virtual_layout(MODEL, NoRecompute(), run, "type:Block", 0, "v-half", None, None, None)
    virtual = virtual_plan(MODEL, layout, run, "v-half")
    plan = with_virtual_plan(plan_run(MODEL, NoRecompute(), layout, virtual_shape(run)), virtual, run)
    ranks = [a + s for a, s in zip(virtual.activation_bytes_per_rank, virtual.state_bytes_per_rank)]
    memory_gb = (max(ranks) - 1024) / GIB
    assert max(s.predicted_peak_bytes for s in plan.stages) < memory_gb * GIB  # every virtual stage alone fits
    lines = verdict(plan, memory_gb, NoRecompute(), run, "v-half")
    worst = ranks.index(max(ranks))
    assert lines[1 + worst].startswith(f"rank {worst}: predicted peak ") and "over by" in lines[1 + worst]
    assert lines[3] == f"verdict: does not fit: 1 of 2 ranks over {memory_gb:.3f} GiB"
    assert lines[4].startswith(f"+recompute=auto recompute.budget_gb={memory_gb:.4g} recompute.reserve_gb=0 ")
