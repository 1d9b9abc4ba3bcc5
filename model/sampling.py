"""Sampling from the unpipelined GPT with a KV cache: the prompt is encoded once, then each new token costs one
position. Greedy at temperature 0; otherwise softmax(logits / temperature) over the top_k most likely tokens,
drawn with a torch.Generator so that the same seed gives the same tokens."""

from dataclasses import dataclass

import torch

from model.gpt import GPT


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int
    """Tokens to generate after the prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy (the most likely token, no randomness)."""
    top_k: int | None = None
    """Sample only among the k most likely tokens; None = the whole vocabulary."""
    seed: int = 0
    """Seeds the generator that draws the tokens."""
    vocab_size: int | None = None
    """Only ids below this are drawn: the tokenizer's vocabulary when the model's is larger (padded); None = all."""
    stop_id: int | None = None
    """Sampling ends once every row has drawn this id (the tokenizer's end of sequence), as Hugging Face's
    `generate` does; None = always max_new_tokens."""


def next_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> torch.Tensor:
    """Logits (B, vocab) of the last position -> the next token ids (B, 1)."""
    logits = logits[:, : sampling.vocab_size]  # ids past the tokenizer's vocabulary decode to nothing
    if sampling.temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (B, vocab)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate(model: GPT, prompt: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Prompt token ids (B, T) -> the new token ids (B, N): N = max_new_tokens, or fewer when every row drew
    `sampling.stop_id` (a row that drew it earlier goes on sampling; its tokens after the stop mean nothing).
    Runs in eval mode (no dropout) and restores the model's mode. Prompt plus new tokens must fit in model.seq_len
    positions: past them the model has no learned position, and cropping the context (nanoGPT's way) would
    invalidate every cached key."""
    positions = prompt.shape[1] + sampling.max_new_tokens
    if prompt.shape[1] < 1:
        raise ValueError("the prompt must hold at least one token")
    if positions > model.config.seq_len:
        raise ValueError(
            f"the prompt ({prompt.shape[1]} tokens) plus max_new_tokens={sampling.max_new_tokens} is {positions} "
            f"positions, more than model.seq_len={model.config.seq_len}"
        )
    generator = torch.Generator(device=prompt.device).manual_seed(sampling.seed)
    was_training = model.training
    model.eval()
    try:
        caches = model.new_caches(prompt.shape[0])
        logits = model.forward_cached(prompt, caches)  # (B, T, vocab): the whole prompt, once
        new_tokens = []
        stopped = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)  # (B,)
        for _ in range(sampling.max_new_tokens):
            token = next_token(logits[:, -1], sampling, generator)  # (B, 1)
            new_tokens.append(token)
            if sampling.stop_id is not None:
                stopped |= token[:, 0] == sampling.stop_id
                if bool(stopped.all()):
                    break
            if len(new_tokens) < sampling.max_new_tokens:
                logits = model.forward_cached(token, caches)  # (B, 1, vocab): one position
        return torch.cat(new_tokens, dim=1)  # (B, N)
    finally:
        model.train(was_training)
