"""The configs of the commands beside training, registered with Hydra: generate.py and export_hf.py, which use a
trained checkpoint, and prepare_data.py, which writes token files.

Types are checked when Hydra composes the config; `validate()` checks the values, once, before anything is
loaded. Options are top-level (`checkpoint=PATH`, not `generate.checkpoint=PATH`), so messages name them so.
"""

from dataclasses import dataclass

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
    """Tokens to generate; the prompt's tokens plus these must fit in the model's seq_len positions."""
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


SCRIPT_SCHEMAS = {
    "generate_schema": GenerateConfig,
    "export_hf_schema": ExportConfig,
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
