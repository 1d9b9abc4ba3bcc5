"""stagecheck against the pipelines a user would pick instead: plain DeepSpeed and torch.distributed.pipelining.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.pipeline_peers [--rounds 2] [--steps 6] [--json PATH] [--smoke]
        [--frontier PNG [--budgets 6]]

Every configuration is a real 2-rank launch on this CPU (gloo, one thread per rank) of the same GPT shape (8 blocks,
n_embd 256, seq 512, dropout 0.1, math attention, fp32), the same initial weights (stagecheck's seeded init), the same
synthetic batches and 4 micro-batches of one sequence, with AdamW and gradient clipping 1.0:
- plain DeepSpeed (bench/peers_deepspeed.py): PipelineModule + TrainSchedule, activation_checkpoint_interval 1, then 0;
- torch.distributed.pipelining (bench/peers_torch.py): Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble,
  each without and with per-block checkpoint_wrapper;
- stagecheck (`train.py`): full(1), selective, full(stage) under DeepSpeed's 1F1B and under zb-h1 + early recompute,
  its schedules with virtual stages (`parallel.schedule=interleaved-1f1b`, `zb-v`, `v-half`: 2 chunks per rank, as the
  torch peers' interleaved 1F1B and ZBV hold them) without recompute and with selective recompute, and
  `+recompute=auto parallel.schedule=auto recompute.early=null` at a budget equal to each peer's measured peak
  (its largest rank's, in round 1; peers whose budgets give one plan, by the dry run, share one auto run).
Configurations are interleaved in rounds (every one once per round, the order rotated from round to round), so a ratio
within one round compares runs that saw the same machine state. For each: tokens/s (median timed step), measured peak
tensor bytes per rank (parallel/measurement/tensor_peak.py, parameters and optimizer state included), the launch's CPU
and wall time and the load average. `--smoke` checks the plumbing only: a tiny shape, one round, one DeepSpeed peer, one
torch.distributed.pipelining peer, stagecheck's zb-v and stagecheck's auto at the first peer's peak (4 blocks: one per
virtual stage). Not a test of figures: they depend on
the machine; docs/pipeline_peers.md holds a run.

`--frontier PNG` sweeps the budget too: after round 1, stagecheck's auto also runs at `--budgets` budgets evenly from
the memory floor (the smallest peak measured in round 1: full(stage)'s, outside --smoke) to no recompute's peak (the
largest), one run per distinct plan; the end prints, per budget (spanning every run's peaks), each system's fastest
configuration that fits (bench/peer_frontier.py) and draws the frontier, tokens/s against the largest stage's peak,
one line per system, into PNG.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench.peer_frontier import draw_frontier, frontier_table, sweep_budgets
from bench.peer_launch import Peer, Run, run_peer, run_stagecheck
from bench.peer_report import report
from bench.real_runs import REPO, STAGES, TRACE_STEP, Variant, launch_env, model_config, train_args
from parallel.planning.config import AutoRecompute, FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.shapes import GIB
from parallel.planning.virtual_program import VIRTUAL_SCHEDULES

DS_PEERS = (
    Peer("DeepSpeed interval=1", "deepspeed", "interval=1"),
    Peer("DeepSpeed interval=0", "deepspeed", "interval=0"),
)
TORCH_PEERS = tuple(
    Peer(f"torch {schedule}{' + ckpt' if ckpt else ''}", "torch", f"{schedule}{'+ckpt' if ckpt else ''}")
    for schedule in ("1f1b", "interleaved", "zbv")
    for ckpt in (False, True)
)
FULL_STAGE = ("+recompute=full", "recompute.interval=stage")


def fixed_variants(micro_batches: int) -> list[Variant]:
    """stagecheck's fixed modes, under `type:Block` (the blocks split evenly, as the peers split them)."""

    def variant(name: str, recompute, *overrides: str) -> Variant:
        return Variant(name, micro_batches, recompute, "type:Block", overrides, ())

    return [
        variant("stagecheck full(1)", FullRecompute(interval="1"), "+recompute=full", "recompute.interval=1"),
        variant("stagecheck selective", SelectiveRecompute(), "+recompute=selective"),
        variant("stagecheck full(stage) 1f1b", FullRecompute(interval="stage"), *FULL_STAGE),
        variant(
            "stagecheck full(stage) zb-h1 early",
            FullRecompute(interval="stage", early=True),
            *FULL_STAGE,
            "parallel.schedule=zb-h1",
            "recompute.early=true",
        ),
    ]


def virtual_variants(micro_batches: int, modes: tuple[str, ...] = ("none", "selective")) -> list[Variant]:
    """stagecheck's schedules with virtual stages under `modes`, 2 chunks per rank (parallel.chunks=2: interleaved
    1F1B's planner would weigh more) under `type:Block` (the blocks
    split evenly over the 4 virtual stages, as the torch peers split theirs): the rows the issue-34 targets compare
    with torch's interleaved 1F1B and ZBV."""
    early = ("+recompute=full", "recompute.early=true")
    recompute = {
        "none": (NoRecompute(), ()),
        "selective": (SelectiveRecompute(), ("+recompute=selective",)),
        "full": (FullRecompute(interval="1"), ("+recompute=full",)),
        "full early": (FullRecompute(interval="1", early=True), early),
    }
    return [
        Variant(
            f"stagecheck {schedule} {mode}",
            micro_batches,
            recompute[mode][0],
            "type:Block",
            (*recompute[mode][1], f"parallel.schedule={schedule}", "parallel.chunks=2"),
            (),
        )
        for schedule in VIRTUAL_SCHEDULES
        for mode in modes
    ]


def budget_gb(peak_bytes: int) -> float:
    """The peak as recompute.budget_gb, rounded down to 1e-6 GiB, so the budget never exceeds the peak."""
    return math.floor(peak_bytes / GIB * 1e6) / 1e6


def auto_overrides(budget: float) -> tuple[str, ...]:
    return (
        "+recompute=auto",
        f"recompute.budget_gb={budget}",
        "recompute.reserve_gb=0",
        "parallel.schedule=auto",
        "recompute.early=null",
    )


def planned(cfg, budget: float, micro_batches: int, work: Path) -> str | None:
    """What `train.py` plans for auto at `budget`, by its own dry run: the stages' layers and choices, the schedule
    and the early stages (None: the budget is refused)."""
    run_dir = work / f"dry-{budget}"
    variant = Variant("dry", micro_batches, AutoRecompute(), "type:Block", auto_overrides(budget), ())
    # Without a launcher the dry run plans parallel.pipeline_stages stages: the launches' 2.
    cmd = [sys.executable, *train_args(cfg, variant, TRACE_STEP, run_dir), "dry_run=true"]
    cmd.append(f"parallel.pipeline_stages={STAGES}")
    if subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True).returncode != 0:
        return None
    plan = json.loads((run_dir / "plan.json").read_text())
    stages = [(s["layers"], s["choices"], s.get("segments"), s.get("recomputed_micro_batches")) for s in plan["stages"]]
    virtual = plan["virtual"]  # parallel.schedule=auto may choose a schedule with virtual stages: no early stages
    if virtual:
        return json.dumps([stages, virtual["schedule"], []])
    return json.dumps([stages, plan["schedule"], plan["early_stages"]])


def auto_variants(cfg, peers: list[Run], micro_batches: int, work: Path) -> tuple[list[Variant], dict[str, str]]:
    """One auto run per distinct plan among the peers' peaks (at the smallest of the budgets that plan it), and which
    auto run stands for each peer ('refused' where stagecheck refuses the budget)."""
    by_plan: dict[str, float] = {}
    of_peer: dict[str, str] = {}
    for run in sorted((r for r in peers if not r.error), key=lambda r: r.peak):
        budget = budget_gb(run.peak)
        plan = planned(cfg, budget, micro_batches, work)
        if plan is None:
            of_peer[run.name] = "refused"
            continue
        by_plan.setdefault(plan, budget)
        of_peer[run.name] = f"stagecheck auto @ {by_plan[plan]} GiB"
    variants = [
        Variant(
            f"stagecheck auto @ {b} GiB",
            micro_batches,
            AutoRecompute(budget_gb=b, reserve_gb=0),
            "type:Block",
            auto_overrides(b),
            (),
        )
        for b in sorted(set(by_plan.values()))
    ]
    return variants, of_peer


def sweep_variants(cfg, budgets: list[int], micro_batches: int, work: Path, taken: list[Variant]) -> list[Variant]:
    """auto at each of `budgets` (bytes) whose plan no other budget of the sweep, nor a `taken` run, has already."""
    plans = {planned(cfg, v.recompute.budget_gb, micro_batches, work) for v in taken}
    out = []
    for budget in map(budget_gb, budgets):
        plan = planned(cfg, budget, micro_batches, work)
        if plan is None or plan in plans:
            continue
        plans.add(plan)
        recompute = AutoRecompute(budget_gb=budget, reserve_gb=0)
        out.append(
            Variant(
                f"stagecheck auto @ {budget} GiB", micro_batches, recompute, "type:Block", auto_overrides(budget), ()
            )
        )
    return out


def rotated(items: list, k: int) -> list:
    return items[k % len(items) :] + items[: k % len(items)] if items else items


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="steps per launch: 1 warm-up, 1 metered, the rest timed")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="plumbing only: tiny shape, 1 round, 3 steps, 4 launches")
    parser.add_argument("--json", type=Path, help="also write every run's figures here (after each run)")
    parser.add_argument("--from-json", type=Path, help="print the tables of an earlier run's --json file; run nothing")
    parser.add_argument("--frontier", type=Path, help="sweep auto's budget too, and draw the frontier into this PNG")
    parser.add_argument("--budgets", type=int, default=6, help="budgets of the --frontier sweep (floor to top)")
    parser.add_argument(
        "--only", nargs="+", help="run only these configurations, named as the tables name them (no auto runs)"
    )
    parser.add_argument(
        "--virtual-modes",
        nargs="+",
        default=["none", "selective"],
        choices=["none", "selective", "full", "full early"],
        help="the recompute modes of stagecheck's rows with virtual stages ('full early': each recompute early)",
    )
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        runs = [Run(**r) for r in saved["runs"]]
        return 0 if report(runs, saved["peers"], saved["auto_of_peer"], saved["args"]["rounds"]) else 1
    rounds, steps = (1, 3) if args.smoke else (args.rounds, args.steps)
    torch.set_num_threads(1)
    cfg = model_config(args.smoke)
    if args.smoke:  # one block per virtual stage of the virtual-stage row (2 ranks x 2 chunks)
        cfg = replace(cfg, n_layer=4)
    peers = [DS_PEERS[0], TORCH_PEERS[1]] if args.smoke else [*DS_PEERS, *TORCH_PEERS]
    if args.smoke:
        fixed = [v for v in virtual_variants(args.micro_batches, ("none",)) if "zb-v" in v.name]
    else:
        fixed = fixed_variants(args.micro_batches) + virtual_variants(args.micro_batches, tuple(args.virtual_modes))
    if args.only:  # a side-by-side rerun of a few rows: the auto runs need every peer's peak
        peers = [p for p in peers if p.name in args.only]
        fixed = [v for v in fixed if v.name in args.only]
    print(
        f"torch {torch.__version__}; L={cfg.n_layer} h={cfg.n_embd} a={cfg.n_head} s={cfg.seq_len} b=1 "
        f"m={args.micro_batches} dropout={cfg.dropout} fp32 {cfg.attention} attention; 2 ranks on CPU "
        f"({os.cpu_count()} cores), one thread each; {rounds} interleaved rounds, {steps} steps per launch; "
        f"load average {os.getloadavg()[0]:.1f} at the start\n",
        flush=True,
    )
    runs: list[Run] = []
    autos: list[Variant] = []
    of_peer: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="pipeline_peers-") as tmp:
        work = Path(tmp)
        for k in range(rounds):
            todo: list = rotated([*peers, *fixed, *autos], k)
            if k == 0:  # the budgets of auto come from the peers' peaks: peers first
                todo = [*peers, *fixed]
            for item in todo:
                run_dir = work / f"r{k + 1}-{len(runs)}"
                if isinstance(item, Peer):
                    run = run_peer(cfg, item, args.micro_batches, steps, run_dir, k)
                else:
                    run = run_stagecheck(cfg, item, steps, run_dir, k)
                runs.append(run)
                _progress(run, args, peers, of_peer, runs)
            if k == 0 and not args.only:
                peer_runs = [r for r in runs if r.name in {p.name for p in peers}]
                autos, of_peer = auto_variants(cfg, peer_runs, args.micro_batches, work)
                if args.frontier:
                    budgets = sweep_budgets(runs, args.budgets)
                    autos += sweep_variants(cfg, budgets, args.micro_batches, work, autos)
                for variant in autos:
                    runs.append(run_stagecheck(cfg, variant, steps, work / f"r1-{len(runs)}", 0))
                    _progress(runs[-1], args, peers, of_peer, runs)
    print()
    reported = report(runs, [p.name for p in peers], of_peer, rounds)
    if args.frontier:  # the floor and the top of every run, the sweep's own included
        budgets = sweep_budgets(runs, args.budgets)
        print("\n".join(frontier_table(runs, budgets)))
        draw_frontier(runs, budgets, args.frontier)
        print(f"\nthe frontier: {args.frontier}")
    return 0 if reported else 1


def _progress(run: Run, args: argparse.Namespace, peers: list[Peer], of_peer: dict[str, str], runs: list[Run]) -> None:
    """Prints the run's line, and saves every run so far to --json (a long benchmark stopped early keeps them)."""
    if args.json:
        saved = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
        saved |= {"peers": [p.name for p in peers], "auto_of_peer": of_peer, "runs": [asdict(r) for r in runs]}
        args.json.write_text(json.dumps(saved, indent=1) + "\n")
    if run.error:
        print(f"round {run.round + 1} {run.name}: FAILED\n{run.error}", flush=True)
        return
    peaks = " / ".join(f"{b / 2**20:.1f}" for b in run.peak_bytes)
    print(
        f"round {run.round + 1} {run.name}: {run.tokens_per_s:.0f} tok/s, peak {peaks} MiB, launch "
        f"{run.launch_wall_s:.0f} s wall / {run.launch_cpu_s:.0f} s CPU, load {run.load:.1f}"
        + (f"; {run.plan}" if run.plan else ""),
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
