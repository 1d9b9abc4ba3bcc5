"""Accounting (harness/accounting.py) of a run under a schedule with virtual stages: per pipeline rank, not per stage.

A rank's chunks run their layers through the interpreter (parallel/runtime/chunk_work.py), not through a module's
forward that the activation meter could wrap, so a rank's measured activation bytes are its peak of live tensors
above the step's baseline on the metered step (parallel/measurement/tensor_peak.py, as the stage replay measures them:
docs/virtual_stages.md), beside the plan's peak of the rank (parallel/planning/virtual_layout.py)."""

import statistics
from dataclasses import asdict

import torch

from harness.accounting import Accounting
from parallel.measurement.activation_meter import peak_memory_bytes


class RankAccounting(Accounting):
    def _attach_meter(self) -> None:
        """Nothing to attach: the tensor peak meters the whole rank."""

    def _settle_states(self) -> None:
        """The rank's gradients, zeros, where DeepSpeed's zero_grad left None after the last optimizer step: else the
        metered step would allocate them inside its window and its activation bytes would count them, though they are
        states (planned_state_bytes_per_rank). The backward adds into them, and 0 + g is g (a -0.0 comes out +0.0,
        which moves no weight)."""
        for parameter in self.engine.module.parameters():
            if parameter.requires_grad and parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)

    def _meter_engine(self, armed: bool) -> None:
        """No early recompute and no zb-h1 store to meter (parallel/planning/virtual_support.py)."""

    def _this_rank(self) -> dict:
        step_time = statistics.median(self.step_times) if self.step_times else None
        flops = self.plan.flops.model_flops_per_step / self.world_size
        return {
            "rank": self.engine.stage_id,
            "dp_rank": self.engine.grid.get_data_parallel_rank(),
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
        return {
            "activation_measured_at_step": self.measured_step,
            "virtual_stages_per_rank": [list(stages) for stages in virtual.virtual_stages_per_rank],
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
