"""This machine's device signature: what a device profile or a cache of prices must have been measured with to price
a run here (the GPU's or the CPU's name, a rank's intra-op threads, torch's version, the precision). Planning reads
signatures (parallel/planning/device_profile_file.py); only this module asks the machine."""

import platform
from pathlib import Path

import torch

from parallel.planning.device_profile_file import DeviceSignature


def device_name(device: str, index: int = 0) -> str:
    """The GPU's name, or the CPU's model name (Linux's /proc/cpuinfo, else the platform's word for it)."""
    if device == "cuda":
        return torch.cuda.get_device_name(index)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def signature_of(device: str, precision: str, threads: int, index: int = 0) -> DeviceSignature:
    """This machine's signature for a process of `threads` intra-op threads (a GPU's kernels do not depend on
    them: 0 there) on `device` (GPU `index`)."""
    return DeviceSignature(
        device, device_name(device, index), threads if device == "cpu" else 0, torch.__version__, precision
    )
