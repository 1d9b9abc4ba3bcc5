"""Round-trip tests for tests/wandb_file.py against real offline wandb runs.

wandb is run in a subprocess so its service process (wandb-core) and global
state never live inside the pytest process.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import wandb_file as wf

STEPS, KEYS = 50, 40  # ~100 KiB of records: spans several 32 KiB blocks

# Logged values are generated identically in the child (from this source) and
# here, so the test can compare without shipping data back.
VALUES_SRC = """
import math
def row(i):
    r = {f"m{j}": math.sin(i * 1.37 + j) * 10 ** (j % 7 - 3) for j in range(KEYS)}
    r["loss"] = 1 / (i + 3)
    r["tiny"] = 5e-324 * (i + 1)
    r["huge"] = 1.7976931348623157e308 / (i + 1)
    r["nested"] = {"acc": i / 49, "deep": {"lr": 3e-4 * 0.97 ** i}}
    return r
"""

CHILD_SRC = (
    VALUES_SRC
    + """
import json, sys, time, wandb
root = sys.argv[1]
t0 = time.perf_counter()
run = wandb.init(mode="offline", dir=root, project="p", group="g",
                 job_type="selective", tags=["a", "b"], name="my-run",
                 config={"x": 1, "nested": {"y": 2}})
for i in range(STEPS):
    run.log(row(i))
run.config.update({"late": 0.1})
run.config.update({"late": 0.2}, allow_val_change=True)
run.summary["best"] = 0.1 + 0.2
run.summary["final"] = {"epoch": 3, "tag": "done"}
run.summary["blob"] = "".join(chr(65 + k % 26) for k in range(70_000))
run.finish()
print(json.dumps({"seconds": time.perf_counter() - t0, "id": run.id}))
"""
)

RESUME_SRC = """
import json, sys, wandb
root, steps = sys.argv[1], []
for segment in range(2):
    run = wandb.init(mode="offline", dir=root, project="p", id="resumeme",
                     resume="allow", config={"segment": segment})
    steps.append(run.step)
    for i in range(3):
        run.log({"v": float(10 * segment + i)})
    run.finish()
print(json.dumps({"start_steps": steps}))
"""


def run_wandb(script: str, root: Path) -> dict[str, Any]:
    """Run `script` in a fresh interpreter with wandb sandboxed into `root`."""
    # Drop inherited WANDB_* vars (WANDB_RUN_ID, WANDB_PROJECT, WANDB_RESUME,
    # ...) that would silently override init() arguments.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        # Keep wandb's settings, cache (core-debug logs) and data out of ~.
        WANDB_CONFIG_DIR=str(root / "config"),
        WANDB_CACHE_DIR=str(root / "cache"),
        WANDB_DATA_DIR=str(root / "data"),
        WANDB_ARTIFACT_DIR=str(root / "artifacts"),
    )
    prelude = f"STEPS, KEYS = {STEPS}, {KEYS}\n"
    out = subprocess.run(
        [sys.executable, "-c", prelude + script, str(root)],
        cwd=root,  # wandb also reads ./wandb/settings from the cwd
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def expected_row(i: int) -> dict[str, Any]:
    scope: dict[str, Any] = {"KEYS": KEYS}
    exec(VALUES_SRC, scope)
    return scope["row"](i)


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wandb_run")
    result = run_wandb(CHILD_SRC, root)
    print(f"\nwandb.init + {STEPS} logs x {KEYS + 5} keys + finish (offline): {result['seconds']:.3f}s")
    (path,) = wf.find_run_files(root)
    assert path.name == f"run-{result['id']}.wandb"
    return path


def same(a: Any, b: Any) -> bool:
    """Exact equality; integral floats may come back as ints ("2" in JSON)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) or isinstance(b, float):
        return float(a) == float(b) or (math.isnan(a) and math.isnan(b))
    return a == b


def test_spans_blocks(offline_run: Path) -> None:
    data = offline_run.read_bytes()
    assert len(data) > 3 * wf.BLOCK_SIZE
    # The 70 kB summary string must be split FIRST/MIDDLE.../LAST, so some
    # block starts with a MIDDLE chunk (the type is byte 6 of a chunk header).
    boundary_types = {data[b + 6] for b in range(wf.BLOCK_SIZE, len(data) - 6, wf.BLOCK_SIZE)}
    assert wf.MIDDLE in boundary_types
    kinds = [r.WhichOneof("record_type") for r in wf.read_records(offline_run)]
    assert kinds[0] == "header" and kinds[-1] == "exit"


def test_history_exact(offline_run: Path) -> None:
    rows = wf.history(offline_run)
    assert [r["_step"] for r in rows] == list(range(STEPS))
    for i, r in enumerate(rows):
        logged = {k: v for k, v in r.items() if not k.startswith("_")}
        assert same(logged, expected_row(i)), i
        assert {"_runtime", "_timestamp"} <= r.keys()


def test_config(offline_run: Path) -> None:
    assert wf.config(offline_run) == {"x": 1, "nested": {"y": 2}, "late": 0.2}
    assert "_wandb" in wf.config(offline_run, internal=True)


def test_summary(offline_run: Path) -> None:
    s = wf.summary(offline_run)
    assert s["best"] == 0.1 + 0.2  # 0.30000000000000004 survives
    assert s["final"] == {"epoch": 3, "tag": "done"}
    assert s["blob"] == "".join(chr(65 + k % 26) for k in range(70_000))
    last = {k: v for k, v in s.items() if k in expected_row(0)}
    assert same(last, expected_row(STEPS - 1))
    assert s["_step"] == STEPS - 1


def test_run_info(offline_run: Path) -> None:
    info = wf.run_info(offline_run)
    assert offline_run.name == f"run-{info['id']}.wandb"
    assert (info["project"], info["group"], info["job_type"]) == ("p", "g", "selective")
    assert info["tags"] == ["a", "b"]
    assert info["name"] == "my-run"


def test_corruption_raises(offline_run: Path, tmp_path: Path) -> None:
    data = offline_run.read_bytes()
    bad = tmp_path / "run-bad.wandb"
    # Flip one byte at many offsets (header, chunk headers, payloads,
    # block-tail padding): every single-byte change must be detected.
    for pos in [*range(0, 8), *range(8, len(data), 251)]:
        bad.write_bytes(data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1 :])
        with pytest.raises(wf.CorruptWandbFile):
            wf.read_records(bad)
    # A file cut inside a record (as after a crash) is also an error.
    bad.write_bytes(data[: wf.BLOCK_SIZE + 100])
    with pytest.raises(wf.CorruptWandbFile):
        wf.read_records(bad)


def test_offline_resume_writes_new_file(tmp_path: Path) -> None:
    """Documents wandb 0.31.0 behaviour the resume feature must work around:
    offline `resume="allow"` with a fixed id does not resume. Each init gets
    a new offline-run-<time>-<id>[-N] dir and .wandb file, and `_step`
    restarts at 0."""
    result = run_wandb(RESUME_SRC, tmp_path)
    assert result["start_steps"] == [0, 0]
    files = wf.find_run_files(tmp_path)
    assert len(files) == 2 and all(f.name == "run-resumeme.wandb" for f in files)
    segments = sorted(files, key=lambda f: wf.run_info(f)["start_time"])
    for seg, f in enumerate(segments):
        assert not wf.run_info(f)["resumed"]
        assert wf.config(f) == {"segment": seg}
        assert [(r["_step"], r["v"]) for r in wf.history(f)] == [(i, 10 * seg + i) for i in range(3)]
