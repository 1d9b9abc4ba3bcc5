"""generate.py: sample text from a checkpoint on one process, with the tokenizer the run trained with."""

from pathlib import Path

import torch

from data.tokenizer import load_tokenizer
from harness.consolidate import consolidate
from model.sampling import SamplingConfig, generate
from schema.scripts import GenerateConfig
from schema.training import resolve_device


def sample_text(config: GenerateConfig) -> str:
    """The prompt and its continuation, decoded. Raises ValueError naming the option for bad input."""
    device = torch.device(resolve_device(config.device, torch.cuda.is_available(), "device"))
    loaded = consolidate(Path(config.checkpoint), option="checkpoint")
    try:
        tokenizer = load_tokenizer(loaded.tokenizer_dir)
    except ValueError as error:
        raise ValueError(f"checkpoint={config.checkpoint!r}: the run's tokenizer cannot be loaded: {error}") from None
    try:
        # A prompt starts a document: the special tokens the tokenizer puts first (a BOS) start it as in training.
        prompt = tokenizer.before_document + tokenizer.encode(config.prompt)
    except ValueError as error:
        raise ValueError(f"prompt={config.prompt!r} cannot be encoded by the run's tokenizer: {error}") from None
    if not prompt:
        raise ValueError(f"prompt={config.prompt!r} encodes to no token: give text the tokenizer maps to tokens")
    seq_len = loaded.model.config.seq_len
    if len(prompt) + config.max_new_tokens > seq_len:
        raise ValueError(
            f"max_new_tokens={config.max_new_tokens} plus the prompt's {len(prompt)} tokens exceeds the model's "
            f"seq_len={seq_len} positions: set max_new_tokens <= {seq_len - len(prompt)} or shorten the prompt"
        )
    stop_id = tokenizer.eos_id if config.stop_at_eos else None
    sampling = SamplingConfig(
        config.max_new_tokens,
        config.temperature,
        config.top_k,
        config.seed,
        vocab_size=tokenizer.vocab_size,
        stop_id=stop_id,
    )
    model = loaded.model.to(device)
    new_tokens = generate(model, torch.tensor([prompt], device=device), sampling)[0].tolist()  # up to max_new_tokens
    if stop_id is not None and stop_id in new_tokens:
        new_tokens = new_tokens[: new_tokens.index(stop_id)]
    return tokenizer.decode(prompt + new_tokens)
