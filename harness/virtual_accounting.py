"""Accounting (harness/accounting.py) of a run under a schedule with virtual stages: per pipeline rank, not per stage.

A rank's measured activation bytes are its peak of live tensors above the step's baseline on the metered step
(parallel/measurement/tensor_peak.py, as the stage replay measures them: docs/virtual_stages.md), beside the plan's
peak of the rank (parallel/planning/virtual_layout.py); and per virtual stage, what each micro-batch keeps for backward,
recorded by one activation meter per chunk around its forwards and loss (parallel/runtime/chunk_work.py's forward
scope), beside what the stage's plan keeps."""

import statistics
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict

import torch

from harness.accounting import Accounting
from parallel.measurement.activation_meter import ActivationMeter, peak_memory_bytes
from parallel.planning.stage_plan import StagePlan


class RankAccounting(Accounting):
    def _attach_meter(self) -> None:
        """One activation meter per chunk, recording its forwards (and the loss, on the last chunk) on the metered step:
        what each micro-batch keeps for backward, per virtual stage, as a 1F1B stage's meter records it."""
        self.chunk_meters = {
            stage: ActivationMeter(chunk.parameters) for stage, chunk in zip(self.engine.stages, self.engine.chunks)
        }

        def record(stage: int, x: torch.Tensor | None, new: bool) -> AbstractContextManager:
            if not self.meter.armed:
                return nullcontext()
            return self.chunk_meters[stage].record(stage_input=x, new=new)

        self.engine.forward_scope = record

    def _settle_states(self) -> None:
        """The rank's gradients, zeros, where DeepSpeed's zero_grad left None after the last optimizer step: else the
        metered step would allocate them inside its window and its activation bytes would count them, though they are
        states (planned_state_bytes_per_rank). The backward adds into them, and 0 + g is g (a -0.0 comes out +0.0,
        which moves no weight)."""
        for parameter in self.engine.module.parameters():
            if parameter.requires_grad and parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)

    def _meter_engine(self, armed: bool) -> None:
        """Nothing: the engine builds its chunks' interpreters anew every step (parallel/runtime/virtual_engine.py),
        so there is no interpreter to arm for what an early recompute remade or what B holds until its W, which a 1F1B
        stage's summary reports; a virtual-stage run's summary has neither."""

    def _this_rank(self) -> dict:
        step_time = statistics.median(self.step_times) if self.step_times else None
        flops = self.plan.flops.model_flops_per_step / self.world_size
        return {
            "rank": self.engine.stage_id,
            "dp_rank": self.engine.grid.get_data_parallel_rank(),
            "micro_batch_bytes": {
                stage: (self.chunk_meters[stage].bytes_per_micro_batch() or None, self._planned(stage, chunk.plan))
                for stage, chunk in zip(self.engine.stages, self.engine.chunks)
            },
            "tensor_peak": asdict(self.tensor_peak) if self.tensor_peak else None,
            "peak_memory_bytes": max(a for a, _ in self.cuda_peaks)
            if self.cuda_peaks
            else peak_memory_bytes(self.device),
            "tflops": flops / step_time / 1e12 if step_time else None,
        }

    def gather(self) -> dict:
        """Collective over all ranks. Returns the summary entries (meaningful on the loss rank)."""
        ranks = [None] * self.world_size
        torch.distributed.all_gather_object(ranks, self._this_rank())
        virtual = self.plan.virtual
        pipeline = len(virtual.virtual_stages_per_rank)
        first = [next(r for r in ranks if r["rank"] == p and r["dp_rank"] == 0) for p in range(pipeline)]
        peaks = [r["tensor_peak"] for r in first]
        kept = {stage: pair for r in first for stage, pair in r["micro_batch_bytes"].items()}
        return {
            "activation_measured_at_step": self.measured_step,
            "virtual_stages_per_rank": [list(stages) for stages in virtual.virtual_stages_per_rank],
            "activation_bytes_per_micro_batch_per_virtual_stage": [kept[v][0] for v in range(len(kept))],
            "planned_activation_bytes_per_micro_batch_per_virtual_stage": [kept[v][1] for v in range(len(kept))],
            "planned_activation_bytes_per_rank": list(virtual.activation_bytes_per_rank),
            "measured_activation_bytes_per_rank": [p and p["peak_bytes"] - p["baseline_bytes"] for p in peaks],
            "measured_peak_tensor_bytes_per_rank": [p and p["peak_bytes"] for p in peaks],
            "measured_baseline_tensor_bytes_per_rank": [p and p["baseline_bytes"] for p in peaks],
            "tensor_peak_op_per_rank": [p and p["peak_op"] for p in peaks],
            "planned_state_bytes_per_rank": list(virtual.state_bytes_per_rank),
            "peak_memory_bytes_per_rank": [
                max(r["peak_memory_bytes"] for r in ranks if r["rank"] == p) for p in range(pipeline)
            ],
            "peak_memory_kind": "cuda_max_allocated_per_step" if self.device == "cuda" else "cpu_max_rss",
            "model_flops_per_step": self.plan.flops.model_flops_per_step,
            "hardware_flops_per_step": self.plan.flops.hardware_flops_per_step,
            "tflops_per_rank": [r["tflops"] for r in ranks],
            "peak_tflops": self.peak_tflops,
        }

    def _planned(self, stage: int, plan: StagePlan) -> list[int]:
        """What virtual stage `stage` keeps per micro-batch as planned under its `plan`: the plan's bytes for the
        micro-batches it recomputes, none's for the others (per-micro-batch recompute)."""
        estimate = self.plan.stages[stage]
        return [
            estimate.activation_bytes_per_microbatch
            if plan.recomputes_micro_batch(m)
            else estimate.plain_activation_bytes_per_microbatch
            for m in range(self.engine.micro_batches)
        ]
