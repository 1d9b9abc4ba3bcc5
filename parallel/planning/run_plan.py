"""The run plan: per stage, what a run will hold and compute before it runs (plan.json, the dry run's
table, the planned figures in summary.json). The last step of planning: it reads the layout (which already
holds auto's choices) through stage_costs and flops, and nothing in planning reads it back.

`plan_run` returns a typed `RunPlan`; `to_json()` gives plan.json's layout, `RunPlan.from_json` reads it back
(the sweep report), and `lines()` is the dry run's table.
"""

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from model import Block, GPTConfig, layer_param_counts
from parallel.planning.auto_recompute import StageBudget, analytic_costs
from parallel.planning.config import FullRecompute, NoRecompute, RecomputeConfig, SelectiveRecompute
from parallel.planning.flops import (
    head_flops_per_token,
    model_flops_per_token,
    non_embedding_params,
    segment_recompute_flops,
    selective_recompute_flops,
    stage_flops,
)
from parallel.planning.layout import PipelineLayout, per_micro_batch_costs
from parallel.planning.memory_model import attention_kernel, block_full_items, stage_input_bytes, total
from parallel.planning.shapes import GIB, RunShape, Shape, Target
from parallel.planning.stage_costs import block_options, stage_memory
from parallel.planning.stage_plan import plan_stage
from parallel.planning.step_costs import (
    analytic_rates,
    layout_costs,
    lower_bound_s,
    predict_step,
    simulate_stages,
    time_model,
)

COMPARED_MODES = {"none": NoRecompute(), "selective": SelectiveRecompute(), "full": FullRecompute()}
"""The uniform modes whose predicted step time plan.json gives beside the chosen plan's (their defaults)."""
GPU_TARGETS = ("H100", "A100")
"""A CUDA plan's predicted step time and MFU on these, with analytic costs at their peak."""


@dataclass(frozen=True)
class LayerBytes:
    layer: int
    """Flat layer index; -1 for the loss."""
    name: str
    choice: str
    bytes: int


@dataclass(frozen=True)
class BudgetEstimate:
    """`recompute=auto`: one stage against the budget."""

    budget_bytes: int
    predicted_peak_bytes_with_working_set: int
    recompute_working_bytes: int
    least_possible_peak_bytes: int
    recompute_cost: float

    @classmethod
    def of(cls, budget: StageBudget) -> "BudgetEstimate":
        return cls(
            budget.budget_bytes,
            budget.predicted_peak_bytes,
            budget.choice.working_bytes,
            budget.least_bytes,
            budget.choice.cost,
        )


@dataclass(frozen=True)
class StageEstimate:
    stage: int
    layers: tuple[int, int]
    """[first, stop) flat layer indices."""
    blocks: int
    choices: tuple[str, ...]
    """One per block."""
    params: int
    activation_bytes_per_microbatch: int
    stage_input_bytes: int
    in_flight_microbatches: int
    pipe_buffers: int
    peak_activation_bytes: int
    pipe_buffer_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    predicted_peak_bytes: int
    model_flops_per_step: int
    hardware_flops_per_step: int
    recompute_flops_per_step: int
    layer_activation_bytes: tuple[LayerBytes, ...]
    budget: BudgetEstimate | None = None
    """Flattened into the stage's JSON object."""
    recomputed_in_flight: int | None = None
    """Of the micro-batches in flight, those that run under the plan at the peak (`recompute.micro_batches`,
    or all); the others keep `plain_activation_bytes_per_microbatch`. Absent from plan.json files before it."""
    plain_activation_bytes_per_microbatch: int | None = None
    """Kept per micro-batch that runs with no recompute (StagePlan.micro_batches leaves it out)."""
    recomputed_microbatches_per_step: int | None = None
    """Micro-batches of a step that run under the plan (StagePlan.recomputes_micro_batch)."""
    predicted_peak_tensor_bytes: int | None = None
    """Live tensor bytes at the stage's peak moment (StageMemory.peak_tensor_terms), compared with the
    measurement of parallel/measurement/tensor_peak.py. Absent from plan.json files before it."""
    peak_tensor_terms: dict[str, int] | None = None
    """Its named terms; `phase` names the moment of the peak."""

    def to_json(self) -> dict:
        out = {
            f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("layer_activation_bytes", "budget")
        }
        out["layer_activation_bytes"] = [asdict(layer) for layer in self.layer_activation_bytes]
        if self.budget is not None:
            out.update(asdict(self.budget))
        return _plain(out)

    @classmethod
    def from_json(cls, data: dict) -> "StageEstimate":
        budget_keys = [f.name for f in fields(BudgetEstimate)]
        simple = {
            f.name: data[f.name]
            for f in fields(cls)
            if f.name not in ("layer_activation_bytes", "budget") and f.name in data  # older files lack some
        }
        simple.update(layers=tuple(data["layers"]), choices=tuple(data["choices"]))
        budget = BudgetEstimate(**{k: data[k] for k in budget_keys}) if budget_keys[0] in data else None
        return cls(
            **simple,
            layer_activation_bytes=tuple(LayerBytes(**layer) for layer in data["layer_activation_bytes"]),
            budget=budget,
        )


@dataclass(frozen=True)
class PlanTarget:
    device: str
    precision: str
    attention: str
    """model.attention."""
    attention_kernel: str
    """The attention code that really runs (parallel.planning.memory_model.attention_kernel)."""
    dropout: float


@dataclass(frozen=True)
class ChoiceEstimate:
    """One recompute choice for one block, per micro-batch."""

    activation_bytes: int
    saved_bytes: int
    """Against `none`."""
    recompute_flops: int


@dataclass(frozen=True)
class PaperBytes:
    """Korthikanti et al. 2022, bytes per block for 16-bit training with dropout and materialised scores:
    sbh(34 + 5as/h) without recompute, 34sbh selective (attention core), 2sbh full."""

    none: float
    selective: float
    full: float

    @classmethod
    def of(cls, shape: Shape) -> "PaperBytes":
        sbh = shape.bsh
        return cls(sbh * (34 + 5 * shape.a * shape.s / shape.h), 34.0 * sbh, 2.0 * sbh)


@dataclass(frozen=True)
class FlopsEstimate:
    non_embedding_params: int
    model_flops_per_token: int
    head_flops_per_token: int
    tokens_per_step: int
    model_flops_per_step: int
    hardware_flops_per_step: int
    matmul_flops_per_step: int
    hardware_over_model: float


@dataclass(frozen=True)
class StepTimeEstimate:
    """The simulated 1F1B step (parallel/planning/step_sim.py) of the layout, with the costs it was planned with."""

    costs: str
    """`measured` (recompute.profile) or `analytic` (FLOPs at peak, bytes at bandwidth: a lower bound)."""
    device: str
    """What analytic costs are charged at: `cpu` (a nominal core) or a GPU of parallel/planning/flops.py's table."""
    predicted_step_time_s: float
    stage_busy_s: tuple[float, ...]
    stage_idle_s: tuple[float, ...]
    stage_recompute_s: tuple[float, ...]
    """Recompute inside the stage's backward passes, over the step."""
    by_mode_s: dict[str, float]
    """Predicted step time of `none`, `selective` and `full` on the same stages."""
    by_gpu: dict[str, dict[str, float]]
    """CUDA plans: {GPU: {step_time_s, mfu}} with analytic costs at that GPU's peak."""
    schedule: str = "1f1b"
    """The pipeline schedule the layout runs (parallel/planning/schedules.py)."""
    early_stages: tuple[int, ...] = ()
    """Stages that run their recompute early (RecomputeEarly)."""
    lower_bound_s: float | None = None
    """What no schedule of these stages beats: per-stage work plus unavoidable dependencies."""
    by_schedule: dict[str, dict] = field(default_factory=dict)
    """Each schedule x early setting the planner priced ("zb-h1+early", ...): step_time_s, lower_bound_s,
    stage_peak_bytes (predicted peak tensor bytes), deferred_weights (zb-h1, per stage), fits (the budget),
    allowed (by parallel.schedule and recompute.early), chosen."""


@dataclass(frozen=True)
class RunPlan:
    target: PlanTarget
    recompute: dict
    """The recompute config's fields."""
    pipeline_stages: int
    data_parallel_size: int
    world_size: int
    micro_batches: int
    micro_batch_size: int
    seq_len: int
    stage_input_included: bool
    """Activation bytes per micro-batch include the stage input."""
    stages: tuple[StageEstimate, ...]
    per_block_activation_bytes: tuple[int, ...]
    block_choices: dict[str, ChoiceEstimate]
    korthikanti_per_block_bytes: PaperBytes
    flops: FlopsEstimate
    model: dict
    """The model config's fields."""
    step_time: StepTimeEstimate | None = None
    """Absent from plan.json files written before the step-time model."""

    @property
    def predicted_step_time_s(self) -> float | None:
        return self.step_time.predicted_step_time_s if self.step_time else None

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "step_time"}
        if self.step_time is not None:
            out.update(asdict(self.step_time), step_time_costs=self.step_time.costs)
            del out["costs"]
        out.update(
            target=asdict(self.target),
            stages=[s.to_json() for s in self.stages],
            block_choices={name: asdict(c) for name, c in self.block_choices.items()},
            korthikanti_per_block_bytes=asdict(self.korthikanti_per_block_bytes),
            flops=asdict(self.flops),
        )
        return _plain(out)

    @classmethod
    def from_json(cls, data: dict) -> "RunPlan":
        simple = {f.name: data[f.name] for f in fields(cls) if f.name != "step_time"}
        step_time = None
        if "predicted_step_time_s" in data:
            keys = [f.name for f in fields(StepTimeEstimate) if f.name != "costs"]
            step_time = StepTimeEstimate(costs=data["step_time_costs"], **{k: data[k] for k in keys if k in data})
            step_time = _tuples(step_time)
        return cls(
            **{
                **simple,
                "step_time": step_time,
                "target": PlanTarget(**data["target"]),
                "stages": tuple(StageEstimate.from_json(s) for s in data["stages"]),
                "per_block_activation_bytes": tuple(data["per_block_activation_bytes"]),
                "block_choices": {k: ChoiceEstimate(**v) for k, v in data["block_choices"].items()},
                "korthikanti_per_block_bytes": PaperBytes(**data["korthikanti_per_block_bytes"]),
                "flops": FlopsEstimate(**data["flops"]),
            }
        )

    def lines(self) -> list[str]:
        """The per-stage table the dry run prints (memory in GiB, FLOPs in TFLOP per step)."""
        t, flops = self.target, self.flops
        lines = [
            f"plan for {t.device} {t.precision} | attention {t.attention} ({t.attention_kernel}) | "
            f"dropout {t.dropout} | recompute {self.recompute} | {self.pipeline_stages} stages x "
            f"{self.data_parallel_size} data-parallel | {self.micro_batches} micro-batches of "
            f"{self.micro_batch_size} x {self.seq_len} tokens",
            "activation bytes per micro-batch include the stage input; memory in GiB",
            f"{'stage':>5} {'layers':>9} {'blocks':>6} {'params':>14} {'act/mb':>10} {'in-flight':>9} "
            f"{'peak act':>10} {'param+grad+opt':>14} {'pipe buf':>9} {'pred. peak':>10} {'recomp TFLOP':>12}",
        ]
        for s in self.stages:
            states = s.param_bytes + s.grad_bytes + s.optimizer_bytes
            lines.append(
                f"{s.stage:>5} {s.layers[0]:>4}..{s.layers[1] - 1:<3} {s.blocks:>6} {s.params:>14,} "
                f"{_gib(s.activation_bytes_per_microbatch):>10} {s.in_flight_microbatches:>9} "
                f"{_gib(s.peak_activation_bytes):>10} {_gib(states):>14} {_gib(s.pipe_buffer_bytes):>9} "
                f"{_gib(s.predicted_peak_bytes):>10} {s.recompute_flops_per_step / 1e12:>12.3f}"
            )
        for s in self.stages:
            if s.recomputed_in_flight is not None and s.recomputed_in_flight < s.in_flight_microbatches:
                lines.append(
                    f"stage {s.stage}: recompute for {s.recomputed_in_flight} of {s.in_flight_microbatches} in flight "
                    f"({s.recomputed_microbatches_per_step} of {self.micro_batches} per step), "
                    f"{_gib(s.activation_bytes_per_microbatch)} GiB each; the others none, "
                    f"{_gib(s.plain_activation_bytes_per_microbatch)} GiB each"
                )
        k, blocks = self.korthikanti_per_block_bytes, self.per_block_activation_bytes
        lines.append(
            f"per block: {_gib(max(blocks)) if blocks else '-'} GiB kept (largest block) | paper, 16-bit: "
            f"none {_gib(k.none)}, selective {_gib(k.selective)}, full {_gib(k.full)} GiB"
        )
        lines.append(
            f"model FLOPs/step {flops.model_flops_per_step / 1e12:.3f} TFLOP | hardware FLOPs/step "
            f"{flops.hardware_flops_per_step / 1e12:.3f} TFLOP (x{flops.hardware_over_model:.3f})"
        )
        if self.step_time is not None:
            lines += self.step_time_lines()
        return lines

    def step_time_lines(self) -> list[str]:
        st = self.step_time
        source = "measured costs" if st.costs == "measured" else f"analytic costs at {st.device} peak: a lower bound"
        lines = [
            f"predicted_step_time_s {st.predicted_step_time_s:.4g} ({source}) | same stages: "
            + ", ".join(f"{mode} {t:.4g}" for mode, t in st.by_mode_s.items()),
            "predicted per stage (s): busy "
            + " ".join(f"{t:.4g}" for t in st.stage_busy_s)
            + " | idle "
            + " ".join(f"{t:.4g}" for t in st.stage_idle_s)
            + " | recompute "
            + " ".join(f"{t:.4g}" for t in st.stage_recompute_s),
        ]
        if st.by_schedule:
            early = ", ".join(str(s) for s in st.early_stages) or "none"
            lines.append(
                f"schedule {st.schedule} | early recompute on stages: {early} | lower bound {st.lower_bound_s:.4g} s"
            )
            lines.append(f"{'schedule':>16} {'step (s)':>9} {'bound (s)':>9} {'peak GiB':>9} {'deferred W':>10}")
            for name, o in st.by_schedule.items():
                deferred = " ".join("-" if d is None else str(d) for d in o["deferred_weights"])
                notes = ["chosen"] if o["chosen"] else []
                notes += [] if o["fits"] else ["over budget"]
                notes += [] if o["allowed"] else ["not allowed by parallel.schedule / recompute.early"]
                lines.append(
                    f"{name:>16} {o['step_time_s']:>9.4g} {o['lower_bound_s']:>9.4g} "
                    f"{_gib(max(o['stage_peak_bytes'])):>9} {deferred:>10}  {', '.join(notes)}"
                )
        for gpu, figures in st.by_gpu.items():
            lines.append(
                f"predicted on {gpu} (analytic costs at peak, not measured): step {figures['step_time_s']:.4g} s, "
                f"MFU {figures['mfu']:.1%}"
            )
        return lines


def block_choices(shape: Shape, target: Target) -> dict[str, ChoiceEstimate]:
    """Every recompute choice for one block: bytes kept per micro-batch, saving against none, and the
    forward FLOPs redone in backward. `full` is a one-block segment (its input only)."""
    kernel = attention_kernel(shape, target)
    options = block_options(shape, target, lambda modules: selective_recompute_flops(shape, modules, kernel))
    none = options[0].kept_bytes
    figures = {
        "none": (none, 0),
        "full": (total(block_full_items(shape, target, True)), segment_recompute_flops(shape, 1)),
    }
    figures.update({o.choice: (o.kept_bytes, int(o.cost)) for o in options[1:]})
    return {name: ChoiceEstimate(kept, none - kept, flops) for name, (kept, flops) in figures.items()}


def plan_run(model: GPTConfig, recompute: RecomputeConfig, layout: PipelineLayout, run: RunShape) -> RunPlan:
    shape, target = Shape.of(model, run.micro_batch_size), run.target
    kernel = attention_kernel(shape, target)
    counts = layer_param_counts(layout.recipes)
    stages = []
    for index, (stage, plan) in enumerate(zip(layout.stages, layout.plans)):
        memory = stage_memory(layout.recipes, stage, plan, shape, run, counts, layout.schedule)
        flops = stage_flops(layout.recipes, stage.layers, plan, shape, kernel)
        recomputed = plan.recomputed_count(run.micro_batches)
        stages.append(
            StageEstimate(
                stage=stage.stage,
                layers=(stage.start, stage.stop),
                blocks=sum(layer.is_block for layer in memory.layers),
                choices=tuple(layer.choice for layer in memory.layers if layer.is_block),
                params=memory.params,
                activation_bytes_per_microbatch=memory.activation_bytes,
                stage_input_bytes=stage_input_bytes(stage.stage, shape, target),
                in_flight_microbatches=memory.in_flight,
                pipe_buffers=memory.pipe_buffers,
                peak_activation_bytes=memory.peak_activation_bytes,
                pipe_buffer_bytes=memory.pipe_buffer_bytes,
                param_bytes=memory.states["params"],
                grad_bytes=memory.states["grads"],
                optimizer_bytes=memory.states["optimizer"],
                predicted_peak_bytes=memory.predicted_peak_bytes,
                predicted_peak_tensor_bytes=memory.predicted_peak_tensor_bytes,
                peak_tensor_terms=memory.peak_tensor_terms,
                model_flops_per_step=flops.model * run.micro_batches,
                hardware_flops_per_step=flops.model * run.micro_batches + flops.recompute * recomputed,
                recompute_flops_per_step=flops.recompute * recomputed,
                layer_activation_bytes=tuple(
                    LayerBytes(layer.flat_index, layer.name, layer.choice, layer.bytes) for layer in memory.layers
                ),
                budget=BudgetEstimate.of(layout.budgets[index]) if layout.budgets else None,
                recomputed_in_flight=memory.recomputed_in_flight,
                plain_activation_bytes_per_microbatch=memory.plain_activation_bytes,
                recomputed_microbatches_per_step=recomputed,
            )
        )
    data_parallel = run.topology.data_parallel_size
    tokens_per_step = run.tokens_per_step(model.seq_len)
    model_flops = model_flops_per_token(model) * tokens_per_step
    step_time = _step_time(layout, run, shape, counts, model_flops) if layout.timing else None
    recompute_flops = sum(s.recompute_flops_per_step for s in stages) * data_parallel
    return RunPlan(
        target=PlanTarget(target.device, target.precision, model.attention, kernel, model.dropout),
        recompute=vars(recompute),
        pipeline_stages=len(stages),
        data_parallel_size=data_parallel,
        world_size=len(stages) * data_parallel,
        micro_batches=run.micro_batches,
        micro_batch_size=run.micro_batch_size,
        seq_len=model.seq_len,
        stage_input_included=True,
        stages=tuple(stages),
        per_block_activation_bytes=tuple(
            layer.bytes for s in stages for layer in s.layer_activation_bytes if layer.choice != "-"
        ),
        block_choices=block_choices(shape, target),
        korthikanti_per_block_bytes=PaperBytes.of(shape),
        flops=FlopsEstimate(
            non_embedding_params=non_embedding_params(model),
            model_flops_per_token=model_flops_per_token(model),
            head_flops_per_token=head_flops_per_token(model),
            tokens_per_step=tokens_per_step,
            model_flops_per_step=model_flops,
            hardware_flops_per_step=model_flops + recompute_flops,
            matmul_flops_per_step=sum(s.model_flops_per_step for s in stages) * data_parallel,
            hardware_over_model=(model_flops + recompute_flops) / model_flops,
        ),
        model=vars(model),
        step_time=step_time,
    )


def _step_time(layout: PipelineLayout, run: RunShape, shape: Shape, counts, model_flops: int) -> StepTimeEstimate:
    timing = layout.timing
    costs = layout_costs(timing, layout.recipes, layout.stages, layout.plans, run, counts)
    costs = [per_micro_batch_costs(c, plan, run.micro_batches) for c, plan in zip(costs, layout.plans)]
    early = [plan.early for plan in layout.plans]
    timeline = simulate_stages(
        costs, run.micro_batches, layout.schedule, early, [plan.deferred_weights for plan in layout.plans]
    )
    is_block = [[layout.recipes[i].module_class is Block for i in s.layers] for s in layout.stages]
    by_mode = {
        mode: predict_step(
            timing, layout.recipes, layout.stages, [plan_stage(b, config) for b in is_block], run, counts
        ).step_time_s
        for mode, config in COMPARED_MODES.items()
    }
    by_gpu = {}
    if run.target.device == "cuda":
        table = analytic_costs(shape, run.target)
        for gpu in GPU_TARGETS:
            rates = analytic_rates("cuda", run.target.precision, gpu=gpu)
            step = predict_step(
                time_model(shape, run, table, rates), layout.recipes, layout.stages, layout.plans, run, counts
            ).step_time_s
            peak = rates.flops_per_s * run.topology.world_size
            by_gpu[rates.name] = {"step_time_s": step, "mfu": model_flops / step / peak}
    stages = range(len(layout.stages))
    return StepTimeEstimate(
        costs=timing.source,
        device=timing.rates.name,
        predicted_step_time_s=timeline.step_time_s,
        stage_busy_s=tuple(timeline.busy_s(s) for s in stages),
        stage_idle_s=tuple(timeline.idle_s(s) for s in stages),
        stage_recompute_s=tuple(run.micro_batches * c.recompute for c in costs),
        by_mode_s=by_mode,
        by_gpu=by_gpu,
        schedule=layout.schedule,
        early_stages=tuple(s for s in stages if early[s]),
        lower_bound_s=lower_bound_s(costs, run.micro_batches, any(early)),
        by_schedule={
            o.schedule + ("+early" if o.early else ""): {
                "step_time_s": o.step_time_s,
                "lower_bound_s": o.lower_bound_s,
                "stage_peak_bytes": list(o.peak_bytes),
                "deferred_weights": [p.deferred_weights for p in o.plans],
                "fits": o.fits,
                "allowed": o.allowed,
                "chosen": o.schedule == layout.schedule and o.early == any(early),
            }
            for o in layout.schedule_options
        },
    )


def _tuples(st: StepTimeEstimate) -> StepTimeEstimate:
    """JSON lists back into the tuples the dataclass holds."""
    sequences = ("stage_busy_s", "stage_idle_s", "stage_recompute_s", "early_stages")
    return StepTimeEstimate(**{**asdict(st), **{k: tuple(getattr(st, k)) for k in sequences}})


def _gib(n: float) -> str:
    return f"{n / GIB:.3f}" if n < 10 * GIB else f"{n / GIB:.1f}"


def _plain(value: Any) -> Any:
    """JSON's own types: tuples become lists, as json.loads would give them back."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
