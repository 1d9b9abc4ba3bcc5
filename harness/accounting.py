"""What each rank holds and computes during training: measured activation bytes per micro-batch (on
one step only), micro-batches in flight, the most activation bytes held at once under the stage's schedule, peak
memory (the resident set, and on the same step the peak of live tensors against the planner's), and FLOP/s, MFU
and HFU.

The trainer calls `before_step` / `after_step` around each step, adds `step_record` to the logged
metrics, and merges `gather()` (a collective: every rank calls it) into summary.json and W&B.
"""

import statistics
from dataclasses import asdict

import torch

from harness.context import RunContext
from parallel.measurement.activation_meter import ActivationMeter, attach_to_pipeline, peak_memory_bytes
from parallel.measurement.tensor_peak import TensorPeak, TensorPeakMeter
from parallel.planning.flops import lookup_peak_tflops
from parallel.planning.plan_record import RunPlan
from parallel.planning.schedule_walk import activation_peak, in_flight_micro_batches


def peak_tflops(configured: float | None, device: str, precision: str) -> float | None:
    """train.peak_tflops when set, else the table entry for this GPU; None on CPU or an unknown GPU."""
    if configured is not None:
        return configured
    if device != "cuda":
        return None
    return lookup_peak_tflops(torch.cuda.get_device_name(), precision)


def live_peak(
    kept: list[int],
    recomputed: list[int],
    weights_pending: list[int],
    schedule: str,
    early: bool,
    deferred: int | None,
    stages: int,
    stage: int,
) -> int:
    """The most activation bytes the stage held at once over the metered step: the schedule it ran (`schedule`,
    `early`, `deferred`: its engine's) walked as the planner walks it (parallel/planning/schedule_walk.py), with
    the bytes measured per micro-batch: `kept` by each forward until its backward, `recomputed` by each early
    recompute until its backward (empty: none ran), `weights_pending` by each B until its W (empty: no zb-h1; the
    walk takes one size, the largest). Under 1F1B that is the largest sum over `in_flight` consecutive
    micro-batches; ZB-H1's pending W's and an early recompute hold more, at instructions of their own."""
    n = len(kept)
    pending = max(weights_pending, default=0)
    return activation_peak(schedule, early, kept, pending, recomputed or [0] * n, n, stages, stage, deferred).bytes


def tensor_peaks(first: list[dict], plan: RunPlan) -> dict:
    """Measured peak tensor bytes per stage (parallel/measurement/tensor_peak.py, on the metered step; the first
    data-parallel rank of each stage), and the named terms of the predicted peak (`predicted_peak_bytes_per_stage`)."""
    measured = [r["tensor_peak"] for r in first]
    return {
        "measured_peak_tensor_bytes_per_stage": [m and m["peak_bytes"] for m in measured],
        "measured_baseline_tensor_bytes_per_stage": [m and m["baseline_bytes"] for m in measured],
        "tensor_peak_unaccounted_bytes_per_stage": [m and m["unaccounted_bytes"] for m in measured],
        "tensor_peak_op_per_stage": [m and m["peak_op"] for m in measured],
        "predicted_peak_tensor_terms_per_stage": [s.peak_tensor_terms for s in plan.stages],
    }


class Accounting:
    def __init__(self, ctx: RunContext, plan: RunPlan, engine):
        self.engine = engine
        self.device = ctx.target.device
        self.world_size = ctx.topology.world_size
        self.measure_step = ctx.run.train.measure_step
        self.measured_step: int | None = None
        self.meter = ActivationMeter(engine.module.parameters)
        self.plan = plan
        self._attach_meter()
        self.peak_tflops = peak_tflops(ctx.run.train.peak_tflops, ctx.target.device, ctx.target.precision)
        self.step_times: list[float] = []
        self.tensor_meter = TensorPeakMeter(self.device)  # live tensor bytes of the metered step
        self.tensor_peak: TensorPeak | None = None
        self.cuda_peaks: list[tuple[int, int]] = []
        """(max allocated, max reserved) bytes of each training step on CUDA: the allocator's peaks are reset
        before each step, so start-up, evaluation and checkpoints count for none."""

    def before_step(self, step: int) -> None:
        """Arm the meter for the first step at or after train.measure_step (0: never)."""
        self.meter.armed = self.measure_step > 0 and self.measured_step is None and step >= self.measure_step
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if self.meter.armed:
            self._settle_states()
            self.tensor_meter.start()
        self._meter_engine(self.meter.armed)

    def _settle_states(self) -> None:
        """What must exist before the metered step's window opens: nothing on a 1F1B stage, whose measured peak is held
        against the whole predicted peak, states included."""

    def _attach_meter(self) -> None:
        """The stage's forwards and loss through the activation meter, and the stage's plan."""
        attach_to_pipeline(self.engine.module, self.meter)
        self.stage_plan = self.plan.stages[self.engine.stage_id]

    def _meter_engine(self, armed: bool) -> None:
        """What each early recompute and each B (zb-h1) holds until its backward or W, on the metered step only."""
        interpreter = self.engine.interpreter
        interpreter.early_recompute.measure = interpreter.weight_grads.measure = armed

    @property
    def metering_done(self) -> bool:
        """Whether no step is left to meter (the meters walk the collector's objects: harness/garbage_collection.py)."""
        return self.measure_step <= 0 or self.measured_step is not None

    def after_step(self, step: int, step_time: float) -> None:
        if self.meter.armed:
            self.tensor_peak = self.tensor_meter.stop()
            self.meter.armed = False
            self._meter_engine(False)
            self.measured_step = step
        self.step_times.append(step_time)
        if self.device == "cuda":
            self.cuda_peaks.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))

    def step_record(self, step_time: float) -> dict:
        """Mean achieved model TFLOP/s per rank over the step, and MFU / HFU when the peak is known."""
        flops = self.plan.flops
        per_rank = flops.model_flops_per_step / self.world_size / step_time / 1e12
        record = {"tflops_per_rank": per_rank}
        if self.peak_tflops:
            record["mfu"] = per_rank / self.peak_tflops
            record["hfu"] = record["mfu"] * flops.hardware_over_model
        return record

    def _this_rank(self) -> dict:
        recorded = self.meter.bytes_per_micro_batch()
        step_time = statistics.median(self.step_times) if self.step_times else None
        stage = self.stage_plan
        in_flight = in_flight_micro_batches(self.engine.micro_batches, self.engine.num_stages, self.engine.stage_id)
        return {
            "stage": self.engine.stage_id,
            "dp_rank": self.engine.grid.get_data_parallel_rank(),
            "activation_bytes": max(recorded) if recorded else None,
            "activation_bytes_per_micro_batch": recorded or None,
            "planned_activation_bytes_per_micro_batch": [
                stage.activation_bytes_per_microbatch
                if self.engine.module.stage_plan.recomputes_micro_batch(i)
                else stage.plain_activation_bytes_per_microbatch
                for i in range(self.engine.micro_batches)
            ],
            "peak_activation_bytes": self._live_peak(recorded) if recorded else None,
            "stage_input_bytes": max(self.meter.stage_input_bytes()) if recorded else None,
            "in_flight": in_flight,
            # CUDA: the most allocated in any step's window (what the planner predicts), and the allocator's
            # reserve around it (caching, fragmentation: what the device must actually hold).
            "peak_memory_bytes": max(a for a, _ in self.cuda_peaks)
            if self.cuda_peaks
            else peak_memory_bytes(self.device),
            "peak_reserved_bytes": max(r for _, r in self.cuda_peaks) if self.cuda_peaks else None,
            "tensor_peak": asdict(self.tensor_peak) if self.tensor_peak else None,
            "step_time_s": step_time,
            "tflops": stage.model_flops_per_step / step_time / 1e12 if step_time else None,
            "hardware_tflops": stage.hardware_flops_per_step / step_time / 1e12 if step_time else None,
        }

    def _live_peak(self, kept: list[int]) -> int:
        engine = self.engine
        return live_peak(
            kept,
            engine.interpreter.early_recompute.recomputed_bytes,
            engine.interpreter.weight_grads.held_bytes,
            engine.schedule_kind,
            engine.early,
            engine.deferred_weights,
            engine.num_stages,
            engine.stage_id,
        )

    def gather(self) -> dict:
        """Collective over all ranks. Returns the summary entries (meaningful on the loss rank)."""
        ranks = [None] * self.world_size
        torch.distributed.all_gather_object(ranks, self._this_rank())
        stages = len(self.plan.stages)
        first = [next(r for r in ranks if r["stage"] == s and r["dp_rank"] == 0) for s in range(stages)]
        activation = [r["activation_bytes"] for r in first]
        out = {
            "activation_measured_at_step": self.measured_step,
            "activation_bytes_per_stage": activation,
            "stage_input_bytes_per_stage": [r["stage_input_bytes"] for r in first],
            "planned_activation_bytes_per_stage": [s.activation_bytes_per_microbatch for s in self.plan.stages],
            "in_flight_microbatches_per_stage": [r["in_flight"] for r in first],
            "predicted_peak_bytes_per_stage": [s.predicted_peak_bytes for s in self.plan.stages],
            "activation_bytes_per_micro_batch_per_stage": [r["activation_bytes_per_micro_batch"] for r in first],
            "planned_activation_bytes_per_micro_batch_per_stage": [
                r["planned_activation_bytes_per_micro_batch"] for r in first
            ],
            "peak_activation_bytes_per_stage": [r["peak_activation_bytes"] for r in first],
            "peak_memory_bytes_per_stage": [
                max(r["peak_memory_bytes"] for r in ranks if r["stage"] == s) for s in range(stages)
            ],
            "peak_memory_kind": "cuda_max_allocated_per_step" if self.device == "cuda" else "cpu_max_rss",
            **(
                {
                    "peak_reserved_bytes_per_stage": [
                        max(r["peak_reserved_bytes"] for r in ranks if r["stage"] == s) for s in range(stages)
                    ]
                }
                if self.device == "cuda"
                else {}
            ),
            **tensor_peaks(first, self.plan),
            "model_flops_per_step": self.plan.flops.model_flops_per_step,
            "hardware_flops_per_step": self.plan.flops.hardware_flops_per_step,
            "tflops_per_rank": [r["tflops"] for r in ranks],
            "peak_tflops": self.peak_tflops,
        }
        if self.peak_tflops:
            out["mfu_per_rank"] = [None if r["tflops"] is None else r["tflops"] / self.peak_tflops for r in ranks]
            out["hfu_per_rank"] = [
                None if r["hardware_tflops"] is None else r["hardware_tflops"] / self.peak_tflops for r in ranks
            ]
        return out
