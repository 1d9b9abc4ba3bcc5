"""The end-of-sequence token of a tokenizer.json: named by the user, by a tokenizer_config.json beside it (as a
Hugging Face model folder has), or the first of the usual names the tokenizer holds."""

from __future__ import annotations

import json
import os

import tokenizers

# GPT-2 and Qwen, Llama 3, Llama 2 and Mistral, Gemma.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
TOKENIZER_CONFIG = "tokenizer_config.json"


def find_eos(hf: tokenizers.Tokenizer, tokenizer_path: str, requested: str | None = None) -> tuple[str, int] | None:
    """(token, id) of the end-of-sequence token; None when nothing names one. ValueError when ``requested`` (or the
    tokenizer_config.json's eos_token) is not a token of the tokenizer."""
    if requested is not None:
        return requested, _token_id(hf, requested, f"eos_token={requested!r}")
    configured = _configured_eos(os.path.join(os.path.dirname(os.path.abspath(tokenizer_path)), TOKENIZER_CONFIG))
    if configured is not None:
        return configured, _token_id(hf, configured, f"the eos_token {configured!r} of its {TOKENIZER_CONFIG}")
    for token in EOS_CANDIDATES:
        token_id = hf.token_to_id(token)
        if token_id is not None:
            return token, token_id
    return None


def _token_id(hf: tokenizers.Tokenizer, token: str, what: str) -> int:
    token_id = hf.token_to_id(token)
    if token_id is None:
        raise ValueError(f"{what} is not a token of the tokenizer: set eos_token to one of its tokens")
    return token_id


def _configured_eos(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            eos = json.load(handle).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None  # no readable tokenizer_config.json: fall back to the usual names
    if isinstance(eos, dict):  # older files: {"content": "</s>", ...}
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None
