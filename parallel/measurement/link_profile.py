"""The link curves of a device profile: point-to-point seconds (one way) and a two-rank all-reduce, each over
message bytes, measured by two processes started here (gloo on CPU, NCCL between two GPUs of this node).

One way is half a ping-pong's round trip: rank 0 sends, rank 1 receives and sends back. Sizes are interleaved
round by round, and each figure is kernel_timing's robust statistic of its rounds.
"""

import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.measurement.kernel_timing import robust_seconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sizes(max_bytes: float, points: int) -> list[int]:
    return [round(1024 * (max_bytes / 1024) ** (i / (points - 1))) // 4 * 4 for i in range(points)]


def _rank(rank: int, port: int, device: str, sizes: list[int], rounds: int, threads: int, out) -> None:
    torch.set_num_threads(threads)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buffers = {size: torch.zeros(size // 4, device=device) for size in sizes}  # fp32: 4 bytes an element
    samples: dict[str, dict[int, list[float]]] = {"p2p": {s: [] for s in sizes}, "allreduce": {s: [] for s in sizes}}

    def ping_pong(tensor: torch.Tensor) -> None:
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        else:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)

    for step in range(rounds + 1):  # the first round warms the connection and the kernels up
        for size, tensor in buffers.items():
            for name, run, share in (("p2p", ping_pong, 0.5), ("allreduce", dist.all_reduce, 1.0)):
                dist.barrier()
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                run(tensor)
                if device == "cuda":
                    torch.cuda.synchronize()
                if step:
                    samples[name][size].append((time.perf_counter() - start) * share)
    if rank == 0:
        out.put(
            {name: [(float(s), robust_seconds(t)) for s, t in by_size.items()] for name, by_size in samples.items()}
        )
    dist.destroy_process_group()


def link_curves(device: str, rounds: int, points: int, max_bytes: float, threads: int) -> dict[str, list]:
    """{"p2p": [(bytes, seconds)], "allreduce": [...]} from two processes of this node."""
    context = mp.get_context("spawn")
    out = context.SimpleQueue()
    mp.start_processes(
        _rank,
        args=(_free_port(), device, _sizes(max_bytes, points), rounds, threads, out),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    return out.get()
