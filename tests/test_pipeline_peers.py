"""The peer benchmark's plumbing (python -m bench.pipeline_peers --smoke), not its figures: a plain DeepSpeed
pipeline, a torch.distributed.pipelining schedule, stagecheck's zb-v (a row of its schedules with virtual stages) and
stagecheck's auto at the DeepSpeed peer's measured peak, each a real 2-rank launch on a tiny shape, one round; the
tables and the saved runs come out, the budget is the peak."""

import json
import subprocess
import sys

import pytest

from bench.pipeline_peers import budget_gb
from tests.runs import REPO, cpu_env, refuse_in_quick_tier

pytestmark = pytest.mark.multiproc


def test_the_smoke_run_measures_every_kind_of_peer_and_plans_auto_at_a_peers_peak(tmp_path):
    refuse_in_quick_tier("bench.pipeline_peers --smoke")
    saved = tmp_path / "peers.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.pipeline_peers", "--smoke", "--json", str(saved)],
        cwd=REPO,
        env=cpu_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(saved.read_text())
    runs = {r["name"]: r for r in record["runs"]}
    ds, torch_1f1b, zb_v = runs["DeepSpeed interval=1"], runs["torch 1f1b + ckpt"], runs["stagecheck zb-v none"]
    auto = runs[record["auto_of_peer"]["DeepSpeed interval=1"]]  # at most the peer's peak, rounded down
    for run in (ds, torch_1f1b, zb_v, auto):  # zb-v: each rank's peak over its 2 chunks
        assert run["error"] is None and len(run["peak_bytes"]) == 2 and all(b > 0 for b in run["peak_bytes"])
        assert len(run["step_s"]) >= 1 and run["loss"] > 0
    assert zb_v["plan"] == "zb-v: none | none | none | none" and ds["plan"] is None  # what each stagecheck run ran
    assert auto["plan"].split(":")[0] in ("1f1b", "zb-h1", "zb-v", "interleaved-1f1b", "v-half")
    budget = budget_gb(max(ds["peak_bytes"]))
    assert budget <= max(ds["peak_bytes"]) / 2**30 < budget + 1e-6
    assert float(auto["name"].split("@ ")[1].removesuffix(" GiB")) <= budget
    assert "## Targets" in done.stdout and "| DeepSpeed interval=1 |" in done.stdout
    assert "| stagecheck zb-v none |" in done.stdout
    replay = subprocess.run(
        [sys.executable, "-m", "bench.pipeline_peers", "--from-json", str(saved)],
        cwd=REPO,
        env=cpu_env(tmp_path),
        capture_output=True,
        text=True,
    )
    assert replay.returncode == 0 and "## Targets" in replay.stdout
