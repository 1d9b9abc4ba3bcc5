"""DeepSpeed's accelerator, chosen once, for train.device, before the runtime loads DeepSpeed.

DeepSpeed settles its accelerator the first time anything asks for it (`get_accelerator()` in
deepspeed/accelerator/real_accelerator.py: DS_ACCELERATOR if set, else whatever device it detects), and its modules
ask while they are being imported, so the choice is made by the first DeepSpeed import and never changes after.
Start-up calls `use_accelerator` before it imports the modules that load DeepSpeed (harness/trainer.py); a process
whose DeepSpeed settled on another accelerator earlier is refused rather than trained on the wrong one. Planning,
the dry run and the sweep report load no DeepSpeed, so they need no choice.
"""

import os
import sys


def settled_accelerator() -> str | None:
    """The device name of the accelerator DeepSpeed has settled on in this process; None while it has not."""
    real = sys.modules.get("deepspeed.accelerator.real_accelerator")
    chosen = getattr(real, "ds_accelerator", None)
    return None if chosen is None else chosen.device_name()


def use_accelerator(device: str) -> None:
    """Make `device` (train.device, resolved: cpu or cuda) DeepSpeed's accelerator, over any DS_ACCELERATOR in the
    environment (train.device is the run's choice), and load DeepSpeed's accelerator with it. Raises ValueError
    when DeepSpeed already settled on another one in this process: a sweep's jobs share one process, and with it
    one accelerator."""
    settled = settled_accelerator()
    if settled is None:
        os.environ["DS_ACCELERATOR"] = device
        from deepspeed.accelerator import get_accelerator  # loads DeepSpeed, which settles on DS_ACCELERATOR

        settled = get_accelerator().device_name()
    if settled != device:
        raise ValueError(
            f"train.device={device!r}, but DeepSpeed already runs on its {settled!r} accelerator in this process: "
            "it is chosen once, when DeepSpeed is first loaded (by an earlier job of this sweep, which must then "
            "share train.device, or by a module loaded before start-up chose)"
        )
