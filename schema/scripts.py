"""The configs of the commands beside training, registered with Hydra: generate.py, export_hf.py and evaluate.py,
which use a trained checkpoint, and prepare_data.py, which writes token files.

Types are checked when Hydra composes the config; `validate()` checks the values, once, before anything is
loaded. Options are top-level (`checkpoint=PATH`, not `generate.checkpoint=PATH`), so messages name them so.
"""

import os
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from data.prepare_config import PrepareDataConfig
from schema.training import DEVICES

EXPORT_DTYPES = ("bf16", "fp16", "fp32")  # export_hf.py's dtype
CHECKPOINT_HINT = "give a run directory (its latest checkpoint), its checkpoints/ directory or a step directory"


def _check_checkpoint(checkpoint: str | None) -> None:
    if not checkpoint:
        raise ValueError(f"checkpoint={checkpoint!r} is not set: {CHECKPOINT_HINT}")


@dataclass
class GenerateConfig:
    """python generate.py checkpoint=PATH prompt="..." max_new_tokens=N temperature=T top_k=K seed=S"""

    checkpoint: str | None = None
    """The checkpoint to sample from: a run directory (its latest checkpoint), its checkpoints/ directory or a
    checkpoints/step_NNNNNNNN directory."""
    prompt: str = "\n"
    """Text the sample continues, encoded with the tokenizer the run trained with. Hydra trims an unquoted value
    and refuses one holding a comma, a bracket or parenthesis: quote it inside the shell's quotes,
    'prompt="def main("'."""
    max_new_tokens: int = 100
    """Tokens to generate at most; the prompt's tokens plus these must fit in the model's seq_len positions."""
    stop_at_eos: bool = True
    """End the sample at the run tokenizer's end-of-sequence token, which is not printed (as Hugging Face's
    `generate` does); false = always max_new_tokens, on into the next document. A tokenizer without one never
    stops early."""
    temperature: float = 0.8
    """Softmax temperature, >= 0: below 1 sharper, above 1 flatter; 0 = greedy (always the most likely token)."""
    top_k: int | None = 200
    """Sample only among the top_k most likely tokens, >= 1; null = the whole vocabulary."""
    seed: int = 1337
    """Seeds the sampler: the same seed, checkpoint and device give the same text."""
    device: str = "auto"
    """Where the model runs: cpu, cuda, or auto (cuda when available)."""

    def validate(self) -> None:
        _check_checkpoint(self.checkpoint)
        if not self.prompt:
            raise ValueError("prompt='' is empty: give at least one character for the sample to continue")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} is invalid: it must be an integer >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} is invalid: it must be >= 0 (0 = greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} is invalid: it must be an integer >= 1, or null for no limit")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} is unknown: allowed values are {', '.join(DEVICES)}")


@dataclass
class ExportConfig:
    """python export_hf.py checkpoint=PATH out=DIR max_shard_bytes=N dtype=bf16|fp16|fp32"""

    checkpoint: str | None = None
    """The checkpoint to export: a run directory (its latest checkpoint), its checkpoints/ directory or a
    checkpoints/step_NNNNNNNN directory."""
    out: str | None = None
    """A new (or empty) directory to write the Hugging Face model into, of the model type it came from (gpt2, llama,
    qwen2, qwen3, mistral): config.json, generation_config.json, model.safetensors (or shards and
    model.safetensors.index.json), and for a BPE tokenizer tokenizer.json and tokenizer_config.json; a run from
    model.init_from keeps the source's max_position_embeddings, token ids, generation_config.json and tokenizer files
    (chat template). Never overwritten."""
    max_shard_bytes: int = 5_000_000_000
    """Largest weight file, in bytes: weights above it are split into model-0000K-of-0000N.safetensors shards
    plus model.safetensors.index.json, as save_pretrained does (a tensor bigger than this gets a shard of its own).
    Default 5 GB."""
    dtype: str | None = None
    """Dtype of the weights written: bf16, fp16 or fp32 (config.json's `dtype` says which). null: the precision the
    checkpoint trained in (train.precision as resolved; fp32 for checkpoints that do not record it)."""

    def validate(self) -> None:
        _check_checkpoint(self.checkpoint)
        if self.dtype is not None and self.dtype not in EXPORT_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is unknown: allowed values are {', '.join(EXPORT_DTYPES)}, null")
        if not self.out:
            raise ValueError(f"out={self.out!r} is not set: give a new directory to write the Hugging Face model into")
        if self.max_shard_bytes < 1:
            raise ValueError(
                f"max_shard_bytes={self.max_shard_bytes} is invalid: it must be a positive number of bytes"
            )


WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class EvaluateConfig:
    """python evaluate.py checkpoint=PATH tasks=[stagecheck_mc,stagecheck_gen] (or pretrained=DIR)"""

    checkpoint: str | None = None
    """The checkpoint to evaluate in this process: a run directory (its latest checkpoint), its checkpoints/
    directory or a checkpoints/step_NNNNNNNN directory. Give this or pretrained."""
    pretrained: str | None = None
    """Instead of a checkpoint: a Hugging Face directory (export_hf.py's out), evaluated through lm-eval's own `hf`
    model in fp32."""
    tasks: list[str] = field(default_factory=lambda: ["stagecheck_mc", "stagecheck_gen"])
    """lm-eval task names from tasks/ (stagecheck_val_ppl, stagecheck_mc, stagecheck_gen) or from task_dir; quote
    the list in the shell: 'tasks=[stagecheck_mc,stagecheck_val_ppl]'."""
    task_dir: str | None = None
    """A folder of your own lm-eval task YAMLs (`dataset_path: json` with `dataset_kwargs.data_files`, relative to
    the YAML), indexed beside tasks/. Nothing is downloaded: lm-eval's own tasks are not indexed."""
    val_data: str | None = None
    """A folder prepare_data.py wrote: its validation split is stagecheck_val_ppl's documents (needed by that
    task)."""
    out: str | None = None
    """A new (or empty) folder for results.json, samples_<task>.jsonl, the tasks as run and the W&B files; null =
    <run dir>/eval/<step>-<time>-<pid> for a checkpoint (needed for pretrained). Never overwritten."""
    limit: int | None = None
    """Evaluate only the first `limit` documents of each task; null = all."""
    num_fewshot: int | None = None
    """Examples from the task's own split put before each question; null = the task's setting."""
    batch_size: int = 8
    """Sequences per forward pass (loglikelihood requests)."""
    seed: int = 1234
    """Seeds lm-eval's sampling of few-shot examples and any sampled generation."""
    device: str = "auto"
    """Where the model runs: cpu, cuda, or auto (cuda when available)."""
    wandb_mode: str = "offline"
    """W&B run of job type "eval" in `out` holding the metrics: offline (a file `wandb sync` uploads), online, or
    disabled."""
    wandb_project: str = "stagecheck"
    """The W&B project of that run."""

    def validate(self) -> None:
        if (self.checkpoint is None) == (self.pretrained is None):
            raise ValueError(
                f"checkpoint={self.checkpoint!r} and pretrained={self.pretrained!r}: give exactly one (a stagecheck "
                f"checkpoint, or a Hugging Face directory)"
            )
        if self.pretrained is not None:
            if not os.path.isfile(os.path.join(self.pretrained, "config.json")):
                raise ValueError(f"pretrained={self.pretrained!r} holds no config.json: give export_hf.py's out")
            if self.out is None:
                raise ValueError("out=None is not set: give a new folder for the results of a pretrained model")
        if not self.tasks:
            raise ValueError("tasks=[] is empty: name at least one task, e.g. tasks=[stagecheck_mc]")
        if self.task_dir is not None and not os.path.isdir(self.task_dir):
            raise ValueError(f"task_dir={self.task_dir!r} is not a folder: give a folder of lm-eval task YAMLs")
        if "stagecheck_val_ppl" in self.tasks and self.val_data is None:
            raise ValueError("val_data=None is not set: stagecheck_val_ppl needs a folder prepare_data.py wrote")
        for name in ("limit", "batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} is invalid: it must be an integer >= 1")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ValueError(f"num_fewshot={self.num_fewshot} is invalid: it must be an integer >= 0")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} is unknown: allowed values are {', '.join(DEVICES)}")
        if self.wandb_mode not in WANDB_MODES:
            raise ValueError(f"wandb_mode={self.wandb_mode!r} is unknown: allowed values are {', '.join(WANDB_MODES)}")


SCRIPT_SCHEMAS = {
    "generate_schema": GenerateConfig,
    "export_hf_schema": ExportConfig,
    "evaluate_schema": EvaluateConfig,
    # data/ owns its schemas, as it does the data group's (data/config.py).
    "prepare_data_schema": PrepareDataConfig,
}


def register_script_schemas() -> None:
    store = ConfigStore.instance()
    for name, schema in SCRIPT_SCHEMAS.items():
        store.store(name=name, node=schema)


def to_script_config(cfg: DictConfig):
    """The composed config as its typed dataclass, values validated; raises ValueError."""
    config = OmegaConf.to_object(cfg)
    config.validate()
    return config
