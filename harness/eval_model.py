"""lm-eval's model interface over a consolidated stagecheck checkpoint, in this process: no export needed to score it.

It reproduces what lm-eval's own Hugging Face model (`hf`, HFLM) does with the export of the same checkpoint, so the
two give the same numbers (tests/test_prepare_data.py checks it): text is encoded as that export's tokenizer encodes
it (the post-processor's special tokens by default), the rolling windows and the left truncation are lm-eval's own,
the first token of a window is conditioned on the BOS the tokenizer puts first (else the EOS), and generation is
greedy until the EOS id, then cut at the first stop sequence, special tokens dropped from the text. Generation runs
on the KV cache that generate.py uses (model/sampling.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from data.tokenizer import Tokenizer
from model import GPT
from model.sampling import SamplingConfig, generate

# HFLM's default for tasks that do not set max_gen_toks.
MAX_GEN_TOKS = 256


class CheckpointLM(TemplateLM):
    """A stagecheck GPT and its run's tokenizer as an lm-eval `LM` (loglikelihood, loglikelihood_rolling,
    generate_until)."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, batch_size: int = 8, seed: int = 0) -> None:
        super().__init__()
        self.model = model.eval()
        self.run_tokenizer = tokenizer
        self.batch_size = batch_size
        self.seed = seed
        self.max_length = model.config.seq_len
        self.model_device = next(model.parameters()).device

    @property
    def eot_token_id(self) -> int:
        return self.run_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        # What a document's first token follows in training: the BOS the tokenizer puts first, else the last EOS.
        return (self.run_tokenizer.before_document or [self.eot_token_id])[0]

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        tokenizer = self.run_tokenizer
        if add_special_tokens is None:  # as HFLM: text that already starts with the prefix token gets no other
            add_special_tokens = not string.startswith(self._decode([self.prefix_token_id], keep_special=True))
        # A character the vocabulary lacks becomes the unknown token, as transformers encodes it, not an error.
        ids = (
            tokenizer.encode(string)
            if tokenizer.hf is None
            else tokenizer.hf.encode(string, add_special_tokens=False).ids
        )
        return tokenizer.before_document + ids + tokenizer.after_document if add_special_tokens else ids

    def _decode(self, ids: list[int], keep_special: bool = False) -> str:
        hf = self.run_tokenizer.hf
        if hf is None:
            return self.run_tokenizer.decode(ids)
        # Ids past the tokenizer's vocabulary (a padded model vocabulary) decode to nothing, as in transformers.
        return hf.decode([i for i in ids if i < self.run_tokenizer.vocab_size], skip_special_tokens=not keep_special)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = []
        for start in range(0, len(requests), self.batch_size):
            batch = requests[start : start + self.batch_size]
            # HFLM's window: the last max_length + 1 tokens of context + continuation, less the last.
            inputs = [(context + continuation)[-(self.max_length + 1) :][:-1] for _, context, continuation in batch]
            width = max(len(i) for i in inputs)
            padded = torch.tensor([i + [0] * (width - len(i)) for i in inputs], device=self.model_device)  # (B, T)
            logits = self.model(padded).float()  # (B, T, vocab); causal: padding on the right changes nothing before
            for row, ((_, _, continuation), tokens) in enumerate(zip(batch, inputs, strict=True)):
                scored = F.log_softmax(logits[row, len(tokens) - len(continuation) : len(tokens)], dim=-1)  # (N, V)
                target = torch.tensor(continuation, device=self.model_device)  # (N,)
                greedy = bool((scored.argmax(dim=-1) == target).all())
                results.append((float(scored.gather(1, target[:, None]).sum()), greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        totals = []
        for (string,) in (request.args for request in requests):
            windows = [
                (None, *utils.make_disjoint_window(window))
                for window in utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            totals.append(sum(logprob for logprob, _ in self._loglikelihood_tokens(windows)))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos_text = self._decode([self.eot_token_id], keep_special=True)
        outputs = []
        for context, gen_kwargs in (request.args for request in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            new = kwargs.pop("max_gen_toks")
            if new >= self.max_length:
                raise ValueError(
                    f"a task asks for max_gen_toks={new}, not less than the model's seq_len={self.max_length}: set "
                    f"generation_kwargs.max_gen_toks below it in the task"
                )
            prompt = self.tok_encode(context)[-(self.max_length - new) :]
            temperature = kwargs.get("temperature", 0.0) if kwargs.get("do_sample") else 0.0
            sampling = SamplingConfig(new, temperature, seed=self.seed)
            tokens = generate(self.model, torch.tensor([prompt], device=self.model_device), sampling)[0].tolist()
            if self.eot_token_id in tokens:  # transformers' generate stops at the EOS id
                tokens = tokens[: tokens.index(self.eot_token_id)]
            outputs.append(postprocess_generated_text(self._decode(tokens), until, None))
        return outputs
