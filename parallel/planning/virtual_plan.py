"""What each rank of a virtual-stage schedule is planned to hold and how long its step takes: plan.json's `virtual`
and the dry run's per-rank lines (parallel/planning/virtual_layout.py builds it)."""

from dataclasses import dataclass

from parallel.planning.shapes import gib_text


@dataclass(frozen=True)
class VirtualPlan:
    """What a rank of the virtual-stage schedule is planned to hold and how long its step takes."""

    schedule: str
    chunks: int
    virtual_stages_per_rank: tuple[tuple[int, ...], ...]
    """Each pipeline rank's virtual stages, in chunk order."""
    activation_bytes_per_rank: tuple[int, ...]
    """Each rank's activation peak: its chunks' kept bytes, deferred W's and received messages at once, or where larger
    what its ReduceGrads or optimizer step allocates after every backward (model_states.rank_step_bytes)."""
    state_bytes_per_rank: tuple[int, ...]
    """Each rank's parameters, gradients and optimizer state: its chunks' together."""
    predicted_step_time_s: float | None
    """The ranks' programmes replayed with each chunk's seconds (parallel/planning/virtual_sim.py)."""
    costs: str | None = None
    """What priced the chunks' seconds (parallel/planning/block_prices.py's sources; None in plan.json files written
    before it was recorded)."""
    cost_source: dict | None = None
    """Which prices: as StepTimeEstimate.cost_source (parallel/planning/step_time_record.py: {kind, path, created}; a
    traced run of measured prices teaches them its residuals). None where the step was not priced, and in plan.json
    files written before."""
    rank_instruction_s: tuple[dict[str, float], ...] = ()
    """Per rank, the simulated seconds of each instruction it runs (parallel/planning/virtual_sim.py's
    VirtualTimeline): what a traced step's instructions are compared with."""
    slots: str = "1:1:1"
    """The slots a forward, a B and a W took when the programmes were laid out (parallel/planning/virtual_slots.py)."""

    @classmethod
    def from_json(cls, data: dict) -> "VirtualPlan":
        return cls(
            **{
                **data,
                "virtual_stages_per_rank": tuple(tuple(s) for s in data["virtual_stages_per_rank"]),
                "activation_bytes_per_rank": tuple(data["activation_bytes_per_rank"]),
                "state_bytes_per_rank": tuple(data["state_bytes_per_rank"]),
                "rank_instruction_s": tuple(data.get("rank_instruction_s", ())),
            }
        )

    def lines(self) -> list[str]:
        """The dry run's and the start-up print's lines: each rank's chunks, planned activation peak and states."""
        step = f"{self.predicted_step_time_s:.4g} s" if self.predicted_step_time_s is not None else "not priced"
        lines = [
            f"schedule {self.schedule}: {self.chunks} chunks per rank, laid out in forward:B:W slots of "
            f"{self.slots} | simulated step {step}"
        ]
        for rank, (stages, peak, states) in enumerate(
            zip(self.virtual_stages_per_rank, self.activation_bytes_per_rank, self.state_bytes_per_rank)
        ):
            lines.append(
                f"rank {rank}: virtual stages {', '.join(map(str, stages))} | planned activation peak "
                f"{gib_text(peak)} GiB | states {gib_text(states)} GiB"
            )
        return lines
