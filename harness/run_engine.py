"""The engine a run's schedule asks for: DeepSpeed's PipelineEngine for one stage per rank (1f1b, zb-h1;
parallel/runtime/engine.py), the virtual engine for ranks x chunks virtual stages (interleaved-1f1b, zb-v, v-half;
parallel/runtime/virtual_engine.py). The trainer drives either through the same calls (harness/trainer.py)."""

from harness.context import RunContext
from harness.hf.init_from import hf_initial_weights
from harness.run_layout import is_virtual
from parallel.planning.layout import PipelineLayout
from parallel.runtime.engine import build_engine
from parallel.runtime.virtual_engine import build_virtual_engine


def build_run_engine(ctx: RunContext, layout: PipelineLayout):
    """This rank's engine over `layout` (its virtual stages under a virtual-stage schedule)."""
    run, target = ctx.run, ctx.target
    options = {
        "initial_weights": hf_initial_weights(ctx),  # model.init_from, unless resuming
        "lr_segment": ctx.resume.lr_segment if ctx.resume is not None else None,
        "compile": run.train.compile,
    }
    if is_virtual(layout):
        return build_virtual_engine(
            layout,
            layout.virtual_schedule,
            layout.virtual_chunks,
            run.train,
            run.parallel,
            target.precision,
            target.device,
            run.recompute,
            **options,
        )
    return build_engine(
        layout, run.train, run.parallel, ctx.topology.data_parallel_size, target.precision, target.device, **options
    )
