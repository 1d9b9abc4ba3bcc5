"""The simulated step of a run plan as typed data (plan.json's step-time fields, the dry run's step-time lines):
parallel/planning/run_plan.py builds it, parallel/planning/plan_record.py's RunPlan holds it."""

from dataclasses import dataclass, field, fields, replace

from parallel.planning.shapes import gib_text


@dataclass(frozen=True)
class StepTimeEstimate:
    """The simulated step (parallel/planning/step_sim.py) of the layout under its schedule, with the costs it was
    planned with."""

    costs: str
    """`measured` (a device profile's curves) or `analytic` (FLOPs and bytes at realistic rates of the device)."""
    device: str
    """What analytic costs are charged at: `cpu` (a nominal core) or a GPU of parallel/planning/flops.py's table."""
    predicted_step_time_s: float
    stage_busy_s: tuple[float, ...]
    stage_idle_s: tuple[float, ...]
    stage_recompute_s: tuple[float, ...]
    """Recompute inside the stage's backward passes, over the step."""
    by_mode_s: dict[str, float]
    """Predicted step time of `none`, `selective` and `full` on the same stages, under the same schedule and early
    recompute setting."""
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
    cost_source: dict = field(default_factory=lambda: {"kind": "analytic", "path": None, "created": None})
    """Which costs priced the plan: {kind: `profile` or `analytic`, path and created (UTC) of the device profile}."""
    stage_instruction_s: tuple[dict[str, float], ...] = ()
    """Per stage, the predicted seconds of each instruction its programme runs (per micro-batch; ReduceTiedGrads,
    ReduceGrads and OptimizerStep once per step), timed in the simulated step as a trace times it, from reaching the
    instruction to its end (a blocking transfer's or a collective's wait included): what a traced step's instructions
    are compared with."""

    @classmethod
    def from_json(cls, data: dict) -> "StepTimeEstimate":
        """From plan.json, whose top level holds these fields (the costs as `step_time_costs`); JSON's lists back into
        the tuples the dataclass holds."""
        keys = [f.name for f in fields(cls) if f.name != "costs"]
        estimate = cls(costs=data["step_time_costs"], **{k: data[k] for k in keys if k in data})
        sequences = ("stage_busy_s", "stage_idle_s", "stage_recompute_s", "early_stages", "stage_instruction_s")
        return replace(estimate, **{k: tuple(getattr(estimate, k)) for k in sequences})

    def lines(self, tokens_per_step: int) -> list[str]:
        """The dry run's step-time lines, for a step of `tokens_per_step` tokens (every replica's)."""
        kind, path, created = self.cost_source["kind"], self.cost_source["path"], self.cost_source["created"]
        source = {
            "measured": f"measured at this shape by the stage replay ({path}, {created})",
            "profile": f"device profile {path}, measured {created}",
            "corrected_curves": f"device profile {path}'s curves corrected by the shapes measured here",
        }.get(kind, f"analytic costs at realistic {self.device} rates, no device profile")
        lines = [
            f"predicted_step_time_s {self.predicted_step_time_s:.4g}: {tokens_per_step:,} tokens per step, "
            f"{tokens_per_step / self.predicted_step_time_s:,.0f} tokens/s ({source}) | same stages and schedule: "
            + ", ".join(f"{mode} {t:.4g}" for mode, t in self.by_mode_s.items()),
            "predicted per stage (s): busy "
            + " ".join(f"{t:.4g}" for t in self.stage_busy_s)
            + " | idle "
            + " ".join(f"{t:.4g}" for t in self.stage_idle_s)
            + " | recompute "
            + " ".join(f"{t:.4g}" for t in self.stage_recompute_s),
        ]
        if self.by_schedule:
            early = ", ".join(str(s) for s in self.early_stages) or "none"
            lines.append(
                f"schedule {self.schedule} | early recompute on stages: {early} | "
                f"lower bound {self.lower_bound_s:.4g} s"
            )
            lines.append(f"{'schedule':>16} {'step (s)':>9} {'bound (s)':>9} {'peak GiB':>9} {'deferred W':>10}")
            for name, o in self.by_schedule.items():
                deferred = " ".join("-" if d is None else str(d) for d in o["deferred_weights"])
                notes = ["chosen"] if o["chosen"] else []
                notes += [] if o["fits"] else ["over budget"]
                notes += [] if o["allowed"] else ["not allowed by parallel.schedule / recompute.early"]
                lines.append(
                    f"{name:>16} {o['step_time_s']:>9.4g} {o['lower_bound_s']:>9.4g} "
                    f"{gib_text(max(o['stage_peak_bytes'])):>9} {deferred:>10}  {', '.join(notes)}"
                )
        for gpu, figures in self.by_gpu.items():
            lines.append(
                f"predicted on {gpu} (analytic costs at realistic rates, not measured): step "
                f"{figures['step_time_s']:.4g} s, {tokens_per_step / figures['step_time_s']:,.0f} tokens/s, "
                f"MFU {figures['mfu']:.1%}"
            )
        return lines
