"""`python train.py ...` runs that end at start-up, each in a child forked from one process that has already imported
what train.py imports (torch, Hydra, the schemas: about 1.5 CPU seconds per fresh interpreter, most of such a run).

The server reads one request per line on stdin (JSON: argv, env, cwd and the files for stdout and stderr), forks, and
the child runs train.py as `__main__` with that argv, environment and working directory, its output in those files,
and exits with train.py's exit code; the server answers with the child's pid, then with its exit code. What each run
does is train.py's own code in a fresh process; only the imports are done once (DeepSpeed's unit tests reuse one
process pool in the same way). tests/runs.py's python_run sends it every run expected to fail at start-up.
"""

import json
import os
import runpy
import sys
import traceback

# train.py's own imports (no DeepSpeed: start-up imports it only once the accelerator is chosen).
import hydra  # noqa: F401

import harness.launcher_args  # noqa: F401
import harness.run_dir  # noqa: F401
import harness.startup  # noqa: F401
import schema  # noqa: F401
import sweep.job  # noqa: F401


def run_child(request: dict) -> None:
    """In the forked child: train.py with the request's argv, environment, working directory and output files."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        file = os.open(path, flags, 0o644)
        os.dup2(file, fd)
        os.close(file)
    sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
    sys.argv = request["argv"]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python train.py` puts the script's folder
    code = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, int | None):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # as the interpreter does: the traceback on stderr, exit code 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
