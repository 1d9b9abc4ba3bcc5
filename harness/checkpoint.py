"""Checkpoints that a kill at any moment cannot spoil, and the choice of where a run resumes.

Layout of <run dir>/checkpoints/:

    latest                          the tag of the newest complete checkpoint; moved last, atomically
    step_00000040/                  one checkpoint (a DeepSpeed tag directory)
        layer_NN-model_states.pt        DeepSpeed: the weights of layer NN, written by its stage
        mp_rank_NN_model_states.pt      DeepSpeed: optimizer, LR scheduler, engine counters, per stage
        stagecheck_rank_00001.pt        ours: the RNG states of rank 1 (Python, NumPy, torch CPU, CUDA)
        stagecheck_tokenizer.json       ours: the run's tokenizer (tokenizer.json beside it for BPE)
        stagecheck_hf_source.json       ours, for a run from model.init_from: what its export keeps of the source
                                        (harness/hf/source.py)
        stagecheck.json                 ours, written by rank 0 once every rank has finished: the step,
                                        the data position, the W&B run id, the topology, the model config,
                                        precision, partition, schedule, learning-rate decay and the whole resolved
                                        config (what a resume is checked against)

DeepSpeed keeps no data position and no RNG state. The data position is the step: a batch is a pure
function of (seed, step, dp_rank, micro) (data/sampling.py), so a run resumed after step k draws
exactly the batches of steps k+1.. that the uninterrupted run drew.

DeepSpeed's own `latest` file is not used (save_latest=False): `save_checkpoint` has global rank 0 write
it as soon as rank 0's own files are written, before its final barrier, while other stages may still be
writing theirs. A kill then would leave `latest` naming a checkpoint with missing stages. Ours moves
only after a barrier that every rank reaches once its files are written.
"""

import json
import os
import random
import re
import secrets
import shutil
import string
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from data.config import data_identity
from data.tokenizer import META_FILE as TOKENIZER_META
from data.tokenizer import TOKENIZER_FILE
from harness.context import RunContext
from harness.faults import save_delay_for_test
from harness.files import atomic_write, atomic_write_json, atomic_write_text, fsync_path
from harness.hf.source import SOURCE_FILE
from parallel.runtime.engine_checkpoint import load_engine_checkpoint
from parallel.runtime.lr_schedule import CosineSegment, apply_current_lr
from schema.training import normalize_resume

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "stagecheck.json"
TAG_PATTERN = re.compile(r"^step_(\d{8,})$")
FORMAT_VERSION = 1
RUN_FILES = (TOKENIZER_META, TOKENIZER_FILE, SOURCE_FILE)  # copied from the run directory into each checkpoint


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rank_state_name(rank: int) -> str:
    return f"stagecheck_rank_{rank:05d}.pt"


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS


def new_wandb_run_id() -> str:
    """8 characters of [a-z0-9], the form W&B generates; or WANDB_RUN_ID when set (a W&B sweep agent sets
    it to the run it started this process for, and wandb.init would otherwise open another run)."""
    return os.environ.get("WANDB_RUN_ID") or "".join(
        secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8)
    )


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    """The checkpoint (tag) directory."""
    meta: dict

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def inside(self, run_dir: Path) -> bool:
        """Whether this checkpoint belongs to the run in `run_dir` (then the run continues in place)."""
        return self.path.resolve().parent == checkpoints_dir(run_dir).resolve()


def read_checkpoint(path: Path, option: str = "train.resume") -> ResumePoint:
    """A complete checkpoint at `path`: a tag directory holding stagecheck.json, or a directory holding
    `latest` (a `checkpoints/` directory, or a run directory's)."""
    path = Path(path).expanduser()
    for pointer in (path / LATEST, path / CHECKPOINTS / LATEST):
        if pointer.is_file():
            path = pointer.parent / pointer.read_text().strip()
            break
    meta_path = path / META
    if not meta_path.is_file():
        raise ValueError(
            f"{option}={str(path)!r} is not a complete stagecheck checkpoint (no {META}): give a "
            f"checkpoints/step_NNNNNNNN directory, a checkpoints/ directory, or a run directory"
        )
    meta = json.loads(meta_path.read_text())
    return ResumePoint(path.resolve(), meta)


def latest_checkpoint(run_dir: Path) -> ResumePoint | None:
    pointer = checkpoints_dir(run_dir) / LATEST
    if not pointer.is_file():
        return None
    return read_checkpoint(pointer.parent / pointer.read_text().strip(), option=f"{pointer} names")


def resume_point(train, run_dir: Path) -> ResumePoint | None:
    """Where this launch starts from, per train.resume (auto, false, or a path); `train` typed or still composed
    (start-up looks before model.init_from is read). Raises ValueError."""
    resume = normalize_resume(train.resume)
    if resume == "false":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    return read_checkpoint(Path(resume))


# ---- RNG states ------------------------------------------------------------------------------------------


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        # This rank's own device only: a resume under another device visibility (srun) has the same one, as
        # the rank's GPU, but not necessarily the others.
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])  # the current device: the rank's own GPU


def checkpoint_tags(root: Path) -> list[tuple[int, Path]]:
    found = []
    if root.is_dir():
        for child in root.iterdir():
            match = TAG_PATTERN.match(child.name)
            if match and child.is_dir():
                found.append((int(match.group(1)), child))
    return sorted(found)


def prune(root: Path, keep: int) -> list[Path]:
    """Keep the checkpoint `latest` names and the keep-1 newest complete ones before it; delete every
    other step directory (older ones, incomplete ones, newer ones from an abandoned timeline)."""
    latest = (root / LATEST).read_text().strip()
    complete = [(step, path) for step, path in checkpoint_tags(root) if (path / META).is_file()]
    latest_step = next(step for step, path in complete if path.name == latest)
    up_to_latest = [path for step, path in complete if step <= latest_step]
    kept = set(up_to_latest[-keep:])
    removed = []
    for _, path in checkpoint_tags(root):
        if path not in kept:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def copy_run_files(run_dir: Path, tag_dir: Path) -> None:
    """The run's tokenizer files (data/tokenizer.py) and its model.init_from record (harness/hf/source.py) go into
    each checkpoint too, so a checkpoint copied away from its run still decodes with the tokenizer that trained it
    and exports as the model it came from (generate.py, export_hf.py)."""
    for name in RUN_FILES:
        if (run_dir / name).is_file():
            shutil.copyfile(run_dir / name, tag_dir / name)


# ---- save and load -----------------------------------------------------------------------------------------


class Checkpointer:
    """Saves and loads through the DeepSpeed engine; every method is collective (all ranks call it)."""

    def __init__(self, ctx: RunContext, engine, wandb_run_id: str | None):
        self.run_dir = ctx.run_dir
        self.root = checkpoints_dir(ctx.run_dir)
        self.engine = engine
        self.rank = ctx.env.rank
        self.topology = ctx.topology
        self.seed = ctx.run.seed
        self.model = asdict(ctx.run.model)
        self.config = ctx.resolved
        self.data_identity = data_identity(ctx.run.data)
        self.precision = ctx.target.precision
        resumed = ctx.resume.lr_segment if ctx.resume is not None else None
        self.lr_segment = resumed or CosineSegment.fresh(ctx.run.train.warmup_steps, ctx.run.train.steps)
        self.keep = ctx.run.train.keep_checkpoints
        self.wandb_run_id = wandb_run_id

    def save(self, step: int) -> Path:
        tag = tag_for(step)
        path = self.root / tag
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            # A leftover of a save that was killed (its `latest` never moved here): start it afresh.
            if path.exists():
                pointer = self.root / LATEST
                if pointer.is_file() and pointer.read_text().strip() == tag:
                    raise RuntimeError(f"refusing to overwrite {path}: `latest` names it")
                shutil.rmtree(path)
        dist.barrier()
        start = time.perf_counter()
        self.engine.save_checkpoint(str(self.root), tag=tag, client_state={"stagecheck_step": step}, save_latest=False)
        atomic_write(path / rank_state_name(self.rank), lambda handle: torch.save(rng_state(), handle), binary=True)
        delay = save_delay_for_test(self.rank, step)
        if delay:
            time.sleep(delay)
        dist.barrier()  # every rank's files are written
        if self.rank == 0:
            copy_run_files(self.run_dir, path)
            for child in path.iterdir():
                if child.is_file():
                    fsync_path(child)  # a power cut must not leave `latest` naming unwritten pages
            atomic_write_json(path / META, self._meta(step))
            atomic_write_text(self.root / LATEST, tag + "\n")
            prune(self.root, self.keep)
            print(f"stagecheck: saved checkpoint {path} ({time.perf_counter() - start:.1f} s)", flush=True)
        dist.barrier()  # nobody leaves (or exits) before `latest` has moved
        return path

    def _meta(self, step: int) -> dict:
        return {
            "format": FORMAT_VERSION,
            "step": step,
            "data": {
                "next_step": step + 1,
                "sampling": "each batch is a pure function of (seed, step, dp_rank, micro)",
                "identity": self.data_identity,  # compared on resume (harness/resume_check.py)
            },
            "seed": self.seed,
            "model": self.model,  # the shape, so the checkpoint alone rebuilds the model (harness/consolidate.py)
            "world_size": self.topology.world_size,
            "pipeline_stages": self.topology.pipeline_stages,
            "data_parallel_size": self.topology.data_parallel_size,
            "precision": self.precision,
            "partition": [int(p) for p in self.engine.module.parts],  # each stage's first layer, then the end
            "schedule": self.engine.schedule_kind,  # the one it ran (auto's choice): a resume keeps its placement
            "lr_schedule": asdict(self.lr_segment),  # the decay a re-stretching resume continues
            # updates applied (the steps less those skipped): the scheduler's count, which a re-stretch starts from
            "applied_updates": int(self.engine.lr_scheduler.last_epoch),
            "config": self.config,  # what a resume is checked against (harness/resume_check.py)
            "wandb_run_id": self.wandb_run_id,
            "rank_states": [rank_state_name(r) for r in range(self.topology.world_size)],
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def load(self, point: ResumePoint) -> int:
        """Restore weights, optimizer, scheduler and engine counters, then this rank's RNG states; returns
        the step the checkpoint was taken after."""
        client = load_engine_checkpoint(self.engine, str(point.path.parent), point.path.name)
        if client.get("stagecheck_step") != point.step:
            raise RuntimeError(
                f"the checkpoint {point.path} is inconsistent: DeepSpeed's state says step "
                f"{client.get('stagecheck_step')}, {META} says {point.step}"
            )
        # The scheduler's state is the checkpoint's; its learning rate for the next step is this launch's.
        apply_current_lr(self.engine.lr_scheduler)
        # Our own file, written by this code: not an untrusted pickle.
        set_rng_state(torch.load(point.path / rank_state_name(self.rank), weights_only=False))
        return point.step
