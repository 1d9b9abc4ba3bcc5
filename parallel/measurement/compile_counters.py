"""What train.compile cost this process, from torch._dynamo's own counters: graphs compiled, graph breaks, and the
seconds dynamo spent compiling frames (tracing, AOTAutograd and inductor included).

A run reads them before its first step, after it (and its evaluation, when due: the evaluation pass runs the blocks
in eval mode without grad, graphs of their own) and at the end: a graph compiled after the first step is a recompile
(a guard failed: another micro-batch, stage or evaluation did not reuse the first step's graphs).
"""

from dataclasses import asdict, dataclass

# dynamo's timer around one frame's whole compile (torch/_dynamo/convert_frame.py, phase entire_frame_compile)
_FRAME_COMPILE = "_compile.compile_inner"


@dataclass(frozen=True)
class CompileCount:
    graphs: int
    """Graphs dynamo captured: one per block variant and grad mode (AOTAutograd compiles its backward with it)."""
    graph_breaks: int
    """Times dynamo split a frame (none can happen under fullgraph=True: it would raise instead)."""
    compile_s: float
    """Seconds spent compiling frames."""

    @classmethod
    def now(cls) -> "CompileCount":
        # Imported here, by a compiled run only: torch._dynamo costs every rank of every run about 1.2 s of CPU.
        from torch._dynamo.utils import compilation_time_metrics, counters

        return cls(
            counters["stats"]["unique_graphs"],
            sum(counters["graph_break"].values()),
            sum(compilation_time_metrics.get(_FRAME_COMPILE, [])),
        )

    def __sub__(self, earlier: "CompileCount") -> "CompileCount":
        return CompileCount(
            self.graphs - earlier.graphs, self.graph_breaks - earlier.graph_breaks, self.compile_s - earlier.compile_s
        )


class CompileWatch:
    """This process's compile counts over a run: its first step's, and everything after it's."""

    def __init__(self):
        self._start = CompileCount.now()
        self._after_first: CompileCount | None = None
        self.first_step: CompileCount | None = None

    def first_step_done(self) -> str:
        """Call after the first step (and its evaluation): returns the start-up print's account of what compiling
        cost."""
        self._after_first = CompileCount.now()
        self.first_step = first = self._after_first - self._start
        return (
            f"train.compile: the first step compiled {first.graphs} graphs in {first.compile_s:.1f} s of compiling, "
            f"{first.graph_breaks} graph breaks"
        )

    def record(self) -> dict | None:
        """For summary.json: the first step's counts, and what every later step and evaluation compiled (None when
        this launch trained no step)."""
        if self._after_first is None:
            return None
        later = CompileCount.now() - self._after_first
        return {"first_step": asdict(self.first_step), "later": asdict(later)}
