"""What a block and the stage's other parts cost in seconds, measured on one device at one shape: the typed record a
device profile is priced into (parallel/planning/op_costs.py) and that the auto planner's cost table
(auto_recompute.measured_costs) and the step-time model (parallel/planning/step_costs.py) read.

Every field is required: a part that was never priced is an error where the record is built, not a silent fall-back to
the analytic model where it is read.
"""

from collections.abc import Iterable
from dataclasses import dataclass, fields

SELECTIVE_PARTS = ("core_attn", "mlp", "mlp_act", "layernorm")
"""The block parts selective recompute redoes (parallel/planning/config.py's recompute.modules)."""


_LINKS = ("transfer", "link_bytes_per_s")


@dataclass(frozen=True)
class MeasuredSeconds:
    """One micro-batch's seconds of each part the planner prices."""

    block_recompute: float
    """A block's forward without autograd: what full recompute redoes per block."""
    core_attn: float
    """The forward of the attention core (softmax(QK^T)V with its dropout): selective `core_attn`."""
    mlp: float
    """The forward of the whole MLP: selective `mlp`."""
    mlp_act: float
    """The MLP's activation (GELU, or the SwiGLU product): selective `mlp_act`."""
    layernorm: float
    """Both of a block's norms: selective `layernorm`."""
    block_forward: float
    """A block's forward with autograd recording."""
    block_backward: float
    """A block's backward, weight gradients included."""
    block_weight_grad: float
    """The part of `block_backward` that makes the Linear layers' weight gradients (ZB-H1's W)."""
    embedding_forward: float
    embedding_backward: float
    head_forward: float
    """Final norm, LM head and loss."""
    head_backward: float
    head_weight_grad: float
    """The part of `head_backward` that is the LM head's weight-gradient matmul (0 under the fused loss)."""
    optimizer_per_param: float
    """The optimizer step per parameter."""
    transfer: float | None
    """One micro-batch's hidden states between neighbouring stages; None where the links were not measured."""
    link_bytes_per_s: float | None
    """The data-parallel all-reduce's rate; None where the links were not measured."""

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None and field.name in _LINKS:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"MeasuredSeconds.{field.name} must be a measured value >= 0, not {value!r}")

    def selective(self, modules: Iterable[str]) -> float:
        """Seconds to recompute these selective parts of one block."""
        unknown = set(modules) - set(SELECTIVE_PARTS)
        if unknown:
            raise ValueError(f"no measured seconds for selective parts {sorted(unknown)}: one of {SELECTIVE_PARTS}")
        return sum(getattr(self, module) for module in modules)
