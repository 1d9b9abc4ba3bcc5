"""The GPT as a flat sequence of layers, and that sequence run in one process.

Flat sequence, gpt2: [token embedding, position embedding, block 0 .. block N-1, final norm, LM head];
llama: [token embedding, block 0 .. block N-1, final norm, LM head] (positions are rotary, inside the blocks).
A tied LM head is the token embedding module again, called through `lm_head`; under the fused loss
(`model.loss_chunk_tokens` > 0) through `final_hidden`, and the loss makes the logits (model/fused_loss.py).
An untied head (llama, model.tie_embeddings=false) is a module of its own, LMHead, built on the last stage only.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from model.config import GPTConfig
from model.kv_cache import KVCache
from model.layers import Block, FinalNorm, PositionEmbedding, TokenEmbedding, final_hidden, lm_head
from model.llama_layers import LlamaBlock, LlamaEmbedding, LlamaFinalNorm, LMHead

TIED_EMBEDDING = "embedding"
FIRST_BLOCK_INDEX = 2  # gpt2's: after the token and position embeddings
BLOCK_CLASSES = (Block, LlamaBlock)


@dataclass(frozen=True)
class LayerRecipe:
    """How to build one entry of the flat sequence."""

    module_class: type
    args: tuple
    tie_key: str | None = None
    """Entries with the same key share one module (and its weights)."""
    forward_fn: Callable | None = None
    """Called as forward_fn(module, x) instead of module(x)."""

    @property
    def name(self) -> str:
        """The layer's name in print-outs and plans: its class, or LMHead for the tied head."""
        return "LMHead" if self.forward_fn else self.module_class.__name__

    def build(self) -> nn.Module:
        return self.module_class(*self.args)


LayerFn = Callable[[torch.Tensor], torch.Tensor]


def build_layers(recipes: Sequence[LayerRecipe]) -> tuple[nn.ModuleList, list[LayerFn]]:
    """The modules of `recipes` (entries with the same tie key share one module, built once) and one
    forward function per entry, in order."""
    modules = nn.ModuleList()
    funcs: list[LayerFn] = []
    tied: dict[str, nn.Module] = {}
    for recipe in recipes:
        module = tied.get(recipe.tie_key) if recipe.tie_key else None
        if module is None:
            module = recipe.build()
            modules.append(module)
            if recipe.tie_key:
                tied[recipe.tie_key] = module
        funcs.append(module if recipe.forward_fn is None else partial(recipe.forward_fn, module))
    return modules, funcs


def block_range(config: GPTConfig) -> range:
    """Flat indices of the blocks: from 2 under gpt2 (token and position embeddings first), from 1 under llama."""
    first = FIRST_BLOCK_INDEX if config.arch == "gpt2" else 1
    return range(first, first + config.n_layer)


def gpt_layers(config: GPTConfig, seed: int, logits: bool = False) -> list[LayerRecipe]:
    """The flat sequence. Its LM head returns the final hidden states when `model.loss_chunk_tokens` fuses the
    logits into the loss, unless `logits` (the unpipelined GPT: sampling, export and references need logits)."""
    returns_logits = logits or config.loss_chunk_tokens == 0
    blocks = block_range(config)
    if config.arch == "gpt2":
        embedding, block, final_norm = TokenEmbedding, Block, FinalNorm
        first = [LayerRecipe(TokenEmbedding, (config, seed, 0), tie_key=TIED_EMBEDDING)]
        first.append(LayerRecipe(PositionEmbedding, (config, seed, 1)))
    else:
        embedding, block, final_norm = LlamaEmbedding, LlamaBlock, LlamaFinalNorm
        tie_key = TIED_EMBEDDING if config.tie_embeddings else None
        first = [LayerRecipe(LlamaEmbedding, (config, seed, 0), tie_key=tie_key)]
    if config.tie_embeddings:
        head_fn = lm_head if returns_logits else final_hidden
        head = LayerRecipe(embedding, (config, seed, 0), tie_key=TIED_EMBEDDING, forward_fn=head_fn)
    else:
        head = LayerRecipe(LMHead, (config, seed, blocks.stop + 1, returns_logits))
    return [
        *first,
        *[LayerRecipe(block, (config, seed, i)) for i in blocks],
        LayerRecipe(final_norm, (config, seed, blocks.stop)),
        head,
    ]


def head_returns_logits(recipe: LayerRecipe) -> bool:
    """Whether the flat sequence's LM head (its last recipe) returns logits rather than the final hidden states
    the fused loss reads."""
    if recipe.module_class is LMHead:
        return recipe.args[3]
    return recipe.forward_fn is lm_head


def head_module(fn: LayerFn) -> nn.Module:
    """The module behind a built entry's forward function: a tied LM head runs as partial(head, embedding)."""
    return fn.args[0] if isinstance(fn, partial) else fn


def module_entries(recipes: Sequence[LayerRecipe]) -> list[int]:
    """Flat indices of the entries that run as a module and so own a state dict: all but a tied LM head, which
    runs as a function of the token embedding. DeepSpeed's pipeline writes one weight file for each of these."""
    return [i for i, recipe in enumerate(recipes) if recipe.forward_fn is None]


class _NoNormalInit(TorchFunctionMode):
    """Skips `normal_`: a meta tensor holds no values to draw, and normal_ on the meta device imports
    torch._dynamo (4 s of every dry run's start-up, for an embedding's initialisation that never happens)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.nn.init.normal_, torch.Tensor.normal_):
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def layer_param_counts(recipes: Sequence[LayerRecipe]) -> list[int]:
    """Trainable parameters of each entry, counted on the meta device; a tied module counts at each of its
    positions, as in DeepSpeed's `parameters` partition method."""
    per_class: dict[type, int] = {}
    with torch.device("meta"), _NoNormalInit():
        for recipe in recipes:
            # Layers of one class share one config, hence one size: build each class once (the 96 blocks
            # of gpt3-175b take seconds to build even on the meta device).
            if recipe.module_class not in per_class:
                per_class[recipe.module_class] = sum(p.numel() for p in recipe.build().parameters() if p.requires_grad)
    return [per_class[recipe.module_class] for recipe in recipes]


def model_param_count(recipes: Sequence[LayerRecipe]) -> int:
    """Trainable parameters of the whole model, a tied module once."""
    seen: set[str] = set()
    total = 0
    for recipe, count in zip(recipes, layer_param_counts(recipes)):
        if recipe.tie_key is None or recipe.tie_key not in seen:
            total += count
        if recipe.tie_key is not None:
            seen.add(recipe.tie_key)
    return total


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (B, T, V), labels (B, T)."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1))


class GPT(nn.Module):
    """The whole flat sequence in one process (no pipeline): the reference the pipeline must match. It always
    returns logits, whatever `model.loss_chunk_tokens` says."""

    def __init__(self, config: GPTConfig, seed: int):
        super().__init__()
        self.config = config
        self.layers, self.forward_funcs = build_layers(gpt_layers(config, seed, logits=True))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx  # (B, T) token ids, then (B, T, C), finally (B, T, vocab) logits
        for fn in self.forward_funcs:
            x = fn(x)
        return x

    @classmethod
    def from_layer_states(cls, config: GPTConfig, states: dict[int, dict[str, torch.Tensor]]) -> "GPT":
        """The model holding `states` ({flat index: state dict} of every module entry, as layer_states() gives),
        built without initialising weights that are replaced at once; the tensors are used as given (dtype,
        device)."""
        with torch.device("meta"):
            model = cls(config, seed=0)
        for index in module_entries(gpt_layers(config, seed=0)):
            model.forward_funcs[index].load_state_dict(states[index], strict=True, assign=True)
        return model

    def layer_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """{flat index: state dict} of every module entry (module_entries): the whole model, the tied weight once."""
        return {i: self.forward_funcs[i].state_dict() for i in module_entries(gpt_layers(self.config, seed=0))}

    @property
    def blocks(self) -> list[nn.Module]:
        blocks = block_range(self.config)
        return self.forward_funcs[blocks.start : blocks.stop]

    def new_caches(self, batch: int) -> list[KVCache]:
        """One empty KV cache per block for `model.seq_len` positions of its n_kv_head key/value heads, in the dtype
        and on the device of the weights."""
        weight = self.forward_funcs[0].head_weight
        c = self.config
        return [KVCache(batch, c.kv_heads, c.seq_len, c.head_size, weight.dtype, weight.device) for _ in self.blocks]

    def forward_cached(self, idx: torch.Tensor, caches: Sequence[KVCache]) -> torch.Tensor:
        """Token ids (B, T) of the T positions after those the caches (one per block) hold -> logits (B, T, vocab):
        the last T positions of forward() on the whole sequence, computing only these T (incremental decoding)."""
        x = self.forward_funcs[0](idx)  # (B, T, C)
        if self.config.arch == "gpt2":
            x = self.forward_funcs[1](x, start=caches[0].length)  # learned positions from the cached length on
        for block, cache in zip(self.blocks, caches, strict=True):
            x = block.forward_cached(x, cache)
        final_norm, head = self.forward_funcs[block_range(self.config).stop :]
        return head(final_norm(x))  # (B, T, vocab)
