"""The tables and the figures of bench/pipeline_peers.py, from its runs."""

import statistics

from bench.peer_launch import Run

MIB = 2**20


def _of(runs: list[Run], name: str) -> dict[int, Run]:
    """The name's successful runs by round."""
    return {r.round: r for r in runs if r.name == name and not r.error}


def _median_tps(runs: list[Run], name: str) -> float | None:
    ok = _of(runs, name)
    return statistics.median(r.tokens_per_s for r in ok.values()) if ok else None


def _ratios(runs: list[Run], num: str, den: str) -> list[float]:
    a, b = _of(runs, num), _of(runs, den)
    return [a[k].tokens_per_s / b[k].tokens_per_s for k in sorted(a.keys() & b.keys())]


def _mib(values) -> str:
    return " / ".join(f"{v / MIB:.1f}" for v in values)


def _configurations(runs: list[Run]) -> None:
    print("## Every configuration\n")
    print(
        "| configuration | tokens/s median | tokens/s per round | measured peak MiB per rank | largest | "
        "launch wall s / CPU s (median) | load | last loss |"
    )
    print("|---|---:|---|---|---:|---|---:|---:|")
    for name in dict.fromkeys(r.name for r in runs):
        failed = [r for r in runs if r.name == name and r.error]
        ok = _of(runs, name)
        if not ok:
            reason = failed[0].error.splitlines()[-1] if failed else "not run"
            print(f"| {name} | does not run | | | | | | {reason[:160]} |")
            continue
        last = ok[max(ok)]
        print(
            f"| {name} | {_median_tps(runs, name):.0f} | {', '.join(f'{r.tokens_per_s:.0f}' for r in ok.values())} "
            f"| {_mib(last.peak_bytes)} | {last.peak / MIB:.1f} "
            f"| {statistics.median(r.launch_wall_s for r in ok.values()):.0f} / "
            f"{statistics.median(r.launch_cpu_s for r in ok.values()):.0f} "
            f"| {', '.join(f'{r.load:.1f}' for r in ok.values())} | {last.loss:.4f} |"
        )
    print()


def _against_peers(runs: list[Run], peers: list[str], of_peer: dict[str, str]) -> dict[str, dict]:
    print("## stagecheck auto (parallel.schedule=auto, recompute.early=null) at each peer's measured peak\n")
    print(
        "| peer | peer tokens/s | peer peak MiB | auto run | auto tokens/s | auto / peer per round | median "
        "| auto peak MiB | <= peer's peak |"
    )
    print("|---|---:|---:|---|---:|---|---:|---:|---|")
    out = {}
    for peer in peers:
        auto = of_peer.get(peer)
        p = _of(runs, peer)
        if not p or auto is None:
            continue
        peer_peak = max(r.peak for r in p.values())
        a = _of(runs, auto) if auto != "refused" else {}
        if not a:
            print(f"| {peer} | {_median_tps(runs, peer):.0f} | {peer_peak / MIB:.1f} | {auto} | - | - | - | - | - |")
            out[peer] = {"auto": auto, "ratio": None}
            continue
        ratios = _ratios(runs, auto, peer)
        auto_peak = max(r.peak for r in a.values())
        out[peer] = {"auto": auto, "ratios": ratios, "ratio": statistics.median(ratios) if ratios else None}
        out[peer] |= {"auto_peak": auto_peak, "peer_peak": peer_peak, "within_peak": auto_peak <= peer_peak}
        print(
            f"| {peer} | {_median_tps(runs, peer):.0f} | {peer_peak / MIB:.1f} | {auto} "
            f"| {_median_tps(runs, auto):.0f} "
            f"| {', '.join(f'{x:.3f}' for x in ratios)} | {out[peer]['ratio']:.3f} | {auto_peak / MIB:.1f} "
            f"| {'yes' if auto_peak <= peer_peak else 'NO'} |"
        )
    print()
    return out


VIRTUAL_PEERS = ("torch interleaved", "torch zbv")
"""torch.distributed.pipelining's schedules with 2 stages per rank, without checkpointing: issue 34's comparison."""
VIRTUAL_ROWS = ("stagecheck interleaved-1f1b", "stagecheck zb-v", "stagecheck v-half")


def _virtual_against(runs: list[Run]) -> dict[str, dict]:
    """For each of VIRTUAL_PEERS: stagecheck's fastest schedule with virtual stages (median tokens/s) whose largest
    rank's peak is within the peer's, per round against it."""
    print("## stagecheck's schedules with virtual stages against torch's interleaved 1F1B and ZBV, at <= their peak\n")
    print("| peer | peer tokens/s | peer peak MiB | stagecheck run | tokens/s | per round | median | peak MiB |")
    print("|---|---:|---:|---|---:|---|---:|---:|")
    rows = [name for name in dict.fromkeys(r.name for r in runs) if name.startswith(VIRTUAL_ROWS) and _of(runs, name)]
    out = {}
    for peer in VIRTUAL_PEERS:
        p = _of(runs, peer)
        if not p:
            continue
        peer_peak = max(r.peak for r in p.values())
        within = [name for name in rows if max(r.peak for r in _of(runs, name).values()) <= peer_peak]
        if not within:
            print(f"| {peer} | {_median_tps(runs, peer):.0f} | {peer_peak / MIB:.1f} | none within its peak | | | | |")
            out[peer] = {"ratio": None}
            continue
        best = max(within, key=lambda name: _median_tps(runs, name))
        ratios = _ratios(runs, best, peer)
        peak = max(r.peak for r in _of(runs, best).values())
        out[peer] = {"run": best, "ratios": ratios, "ratio": statistics.median(ratios) if ratios else None}
        out[peer] |= {"auto_peak": peak, "peer_peak": peer_peak, "within_peak": True}
        median = f"{out[peer]['ratio']:.3f}" if ratios else "-"
        print(
            f"| {peer} | {_median_tps(runs, peer):.0f} | {peer_peak / MIB:.1f} | {best} "
            f"| {_median_tps(runs, best):.0f} | {', '.join(f'{x:.3f}' for x in ratios)} | {median} | {peak / MIB:.1f} |"
        )
    print()
    return out


def _target(label: str, entry: dict | None, goal: float) -> str:
    if not entry or entry.get("ratio") is None:
        return f"- {label}: no figure (a run failed or was refused)"
    met = entry["ratio"] >= goal and entry.get("within_peak", True)
    peak = ""
    if "auto_peak" in entry:
        peak = f", peak {entry['auto_peak'] / MIB:.1f} vs {entry['peer_peak'] / MIB:.1f} MiB"
    return (
        f"- {label}: median {entry['ratio']:.3f}x (per round {', '.join(f'{x:.3f}' for x in entry['ratios'])})"
        f"{peak} -> target >= {goal:.2f}x {'met' if met else 'NOT met'}"
    )


def report(runs: list[Run], peers: list[str], of_peer: dict[str, str], rounds: int) -> dict:
    """Prints the tables and the targets; returns the figures."""
    _configurations(runs)
    against = _against_peers(runs, peers, of_peer)
    virtual = _virtual_against(runs)
    torch_peers = [p for p in peers if p.startswith("torch") and _of(runs, p)]
    fastest = max(torch_peers, key=lambda p: _median_tps(runs, p), default=None)
    hidden = "stagecheck full(stage) zb-h1 early", "stagecheck full(stage) 1f1b"
    zb = _ratios(runs, *hidden)
    figures = {
        "vs DeepSpeed interval=1": against.get("DeepSpeed interval=1"),
        f"vs fastest torch ({fastest})": against.get(fastest) if fastest else None,
        "zb-h1 early / 1f1b, full(stage)": {"ratios": zb, "ratio": statistics.median(zb)} if zb else None,
        **{f"virtual vs {peer}": virtual.get(peer) for peer in VIRTUAL_PEERS},
    }
    print("## Targets\n")
    print(
        _target(
            "stagecheck auto / plain DeepSpeed interval=1, at <= its peak", figures["vs DeepSpeed interval=1"], 1.25
        )
    )
    print(
        _target(
            f"stagecheck auto / the fastest torch.distributed.pipelining schedule ({fastest}), at <= its peak",
            figures[f"vs fastest torch ({fastest})"],
            1.10,
        )
    )
    print(
        _target(
            "stagecheck zb-h1 + early / DeepSpeed's 1F1B, both full(stage), 4 micro-batches",
            figures["zb-h1 early / 1f1b, full(stage)"],
            1.10,
        )
    )
    for peer in VIRTUAL_PEERS:  # issue 34
        label = f"stagecheck's fastest virtual-stage schedule within its peak / {peer}"
        print(_target(label, figures[f"virtual vs {peer}"], 1.03))
    for num, den in (("stagecheck full(1)", "DeepSpeed interval=1"), ("stagecheck selective", "DeepSpeed interval=0")):
        ratios = _ratios(runs, num, den)
        if ratios:
            print(
                f"- {num} / {den}: median {statistics.median(ratios):.3f}x "
                f"(per round {', '.join(f'{x:.3f}' for x in ratios)})"
            )
    print()
    return figures
