"""The run plan as typed data: per stage, what a run will hold and compute before it runs. `RunPlan.to_json()`
gives plan.json's layout, `RunPlan.from_json` reads it back (the sweep report), and `RunPlan.lines()` is the dry
run's table. parallel/planning/run_plan.py builds it.
"""

from dataclasses import asdict, dataclass, fields
from typing import Any

from parallel.planning.model_states import STATE_BYTES, state_bytes_legend
from parallel.planning.shapes import Shape, gib_text
from parallel.planning.step_time_record import StepTimeEstimate
from parallel.planning.virtual_plan import VirtualPlan


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
    least_possible_peak_bytes: int
    recompute_cost: float


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
    """The stage's peak: the most live tensor bytes at once over a step (StageMemory.predicted_peak_bytes, the sum
    of `peak_tensor_terms`), what parallel/measurement/tensor_peak.py measures. In plan.json files written before
    the backward's working set was counted (issue 19) it held the states, pipe buffers and peak activations only."""
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
    peak_tensor_terms: dict[str, int] | None = None
    """The named terms of `predicted_peak_bytes` (StageMemory.peak_tensor_terms): the states, the buffers, the
    activations live at the peak and the backward's working set running then. Absent from plan.json files before
    them."""
    plan: dict | None = None
    """What the stage recomputes (StagePlan.to_record), which `+recompute=plan recompute.file=plan.json` runs as it
    is. Absent from plan.json files before it."""

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
    sbh(34 + 5as/h) without recompute, 34sbh selective (attention core), 2sbh full. For a Llama block (no
    dropout, RMSNorm, rotary q and k, g KV heads, SwiGLU of width f; docs/llama.md derives it), with materialised
    scores: sbh(16 + 6f/h + 2as/h) + 8sb + 4sh/a without recompute, sbh(12 + 4g/a + 6f/h) + 8sb + 4sh/a selective,
    2sbh full (s b h: b sequences of s tokens)."""

    none: float
    selective: float
    full: float

    @classmethod
    def of(cls, shape: Shape) -> "PaperBytes":
        sbh = shape.bsh
        if shape.arch == "llama":
            h, a, f, g = shape.h, shape.a, shape.mlp_width, shape.g or shape.a
            small = 8 * shape.b * shape.s + 4 * shape.s * h / a  # two fp32 rstd per token; rotary cos and sin
            none = sbh * (16 + 6 * f / h + 2 * a * shape.s / h) + small
            return cls(none, sbh * (12 + 4 * g / a + 6 * f / h) + small, 2.0 * sbh)
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
    virtual: VirtualPlan | None = None
    """A run under a schedule with virtual stages (parallel/planning/virtual_layout.py): each rank's chunks, peak and
    step; `stages` are then the virtual stages. None: one stage per rank (and in plan.json files written before)."""
    lossy: str | None = None
    """What compressed stashes (recompute.compress) lose, on which stages (parallel/planning/compression.py's
    lossy_note); None: the run is exact (and in plan.json files written before compression)."""
    considered: tuple[dict, ...] = ()
    """`+recompute=auto` in a dry run: the fastest whole-run plans it weighed (parallel/planning/considered_plans.py's
    ConsideredPlan.to_json: each stage's plan, the simulated step, each stage's peak), each runnable with
    `+recompute=plan`; empty otherwise."""

    @property
    def predicted_step_time_s(self) -> float | None:
        """The run's simulated step: its schedule's over its stages, or over its ranks' chunks (`virtual`)."""
        if self.step_time is not None:
            return self.step_time.predicted_step_time_s
        return self.virtual.predicted_step_time_s if self.virtual is not None else None

    @property
    def prediction_costs(self) -> str | None:
        """What priced `predicted_step_time_s` (parallel/planning/block_prices.py's sources)."""
        return self.step_time.costs if self.step_time is not None else self.virtual and self.virtual.costs

    @property
    def cost_source(self) -> dict | None:
        """Which prices priced `predicted_step_time_s` ({kind, path, created}), None where it was not priced."""
        if self.step_time is not None:
            return self.step_time.cost_source
        return self.virtual.cost_source if self.virtual is not None else None

    @property
    def instruction_s(self) -> tuple[dict[str, float], ...]:
        """Per stage (under a virtual-stage schedule, per rank: a traced step's rows), the simulated seconds of each
        instruction it runs, as a traced step times them."""
        if self.step_time is not None:
            return self.step_time.stage_instruction_s
        return self.virtual.rank_instruction_s if self.virtual is not None else ()

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
            virtual=asdict(self.virtual) if self.virtual else None,
        )
        return _plain(out)

    @classmethod
    def from_json(cls, data: dict) -> "RunPlan":
        simple = {
            f.name: data[f.name] for f in fields(cls) if f.name not in ("step_time", "lossy", "virtual", "considered")
        }
        step_time = StepTimeEstimate.from_json(data) if "predicted_step_time_s" in data else None
        return cls(
            **{
                **simple,
                "step_time": step_time,
                "lossy": data.get("lossy"),
                "considered": tuple(data.get("considered", ())),
                "virtual": VirtualPlan.from_json(data["virtual"]) if data.get("virtual") else None,
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
            "activation bytes per micro-batch include the stage input; memory in GiB; pred. peak: the most live "
            "tensors at once, DeepSpeed's buffers and the backward's working set included",
            f"{'stage':>5} {'layers':>9} {'blocks':>6} {'params':>14} {'act/mb':>10} {'in-flight':>9} "
            f"{'peak act':>10} {'param+grad+opt':>14} {'pipe buf':>9} {'pred. peak':>10} {'recomp TFLOP':>12}",
        ]
        for s in self.stages:
            states = s.param_bytes + s.grad_bytes + s.optimizer_bytes
            lines.append(
                f"{s.stage:>5} {s.layers[0]:>4}..{s.layers[1] - 1:<3} {s.blocks:>6} {s.params:>14,} "
                f"{gib_text(s.activation_bytes_per_microbatch):>10} {s.in_flight_microbatches:>9} "
                f"{gib_text(s.peak_activation_bytes):>10} {gib_text(states):>14} {gib_text(s.pipe_buffer_bytes):>9} "
                f"{gib_text(s.predicted_peak_bytes):>10} {s.recompute_flops_per_step / 1e12:>12.3f}"
            )
        for s in self.stages:
            if s.recomputed_in_flight is not None and s.recomputed_in_flight < s.in_flight_microbatches:
                lines.append(
                    f"stage {s.stage}: recompute for {s.recomputed_in_flight} of {s.in_flight_microbatches} in flight "
                    f"({s.recomputed_microbatches_per_step} of {self.micro_batches} per step), "
                    f"{gib_text(s.activation_bytes_per_microbatch)} GiB each; the others none, "
                    f"{gib_text(s.plain_activation_bytes_per_microbatch)} GiB each"
                )
        if self.lossy:
            lines.append(self.lossy)
        lines.append(self.states_legend())
        k, blocks = self.korthikanti_per_block_bytes, self.per_block_activation_bytes
        lines.append(
            f"per block: {gib_text(max(blocks)) if blocks else '-'} GiB kept (largest block) | paper, 16-bit: "
            f"none {gib_text(k.none)}, selective {gib_text(k.selective)}, full {gib_text(k.full)} GiB"
        )
        lines.append(
            f"model FLOPs/step {flops.model_flops_per_step / 1e12:.3f} TFLOP | hardware FLOPs/step "
            f"{flops.hardware_flops_per_step / 1e12:.3f} TFLOP (x{flops.hardware_over_model:.3f})"
        )
        if self.step_time is not None:
            lines += self.step_time.lines(self.flops.tokens_per_step)
        return lines

    def states_legend(self) -> str:
        """Where param+grad+opt's bytes per parameter come from; the optimizer's sharding read off the stage with the
        most parameters (the plan records no ZeRO stage)."""
        precision = self.target.precision
        stage = max(self.stages, key=lambda s: s.params)
        unsharded = STATE_BYTES[precision][2][0] * stage.params
        shard = max(1, round(unsharded / stage.optimizer_bytes)) if stage.optimizer_bytes else 1
        return state_bytes_legend(precision, shard)

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per predicted step (every data-parallel replica's), per second; None without a step time."""
        step = self.predicted_step_time_s
        return self.flops.tokens_per_step / step if step else None


def _plain(value: Any) -> Any:
    """JSON's own types: tuples become lists, as json.loads would give them back."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
