"""The keys and values one attention layer has seen so far, for incremental decoding."""

import torch


class KVCache:
    """Keys and values (B, nh, T, hs) of the positions decoded so far, in buffers of `max_len` positions
    allocated once, so appending a token copies one position instead of regrowing the whole prefix."""

    def __init__(self, batch: int, n_head: int, max_len: int, head_size: int, dtype: torch.dtype, device):
        shape = (batch, n_head, max_len, head_size)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # (B, nh, max_len, hs)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the keys and values (B, nh, T, hs) of T new positions; return those of every position so far."""
        stop = self.length + k.shape[2]
        if stop > self.k.shape[2]:
            raise ValueError(f"the KV cache holds {self.k.shape[2]} positions, {stop} were asked for")
        self.k[:, :, self.length : stop] = k
        self.v[:, :, self.length : stop] = v
        self.length = stop
        return self.k[:, :, :stop], self.v[:, :, :stop]  # (B, nh, stop, hs) each
