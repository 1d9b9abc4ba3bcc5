"""Posted point-to-point operations, waited for once: a gloo Work waited for twice waits for a completion that never
comes, and the interpreters (parallel/runtime/stage_interpreter.py, parallel/runtime/boundary_links.py) reach the same
posted operation from more than one place (a batch's send completed with its receive, a boundary completed at the end
of the step)."""

from collections.abc import Iterable


class PostedWorks:
    """The Works of operations posted together, waited for on the first `wait` only."""

    def __init__(self, works: Iterable):
        self._works = list(works)

    def wait(self) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait()
