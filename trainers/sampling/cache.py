"""The decode loop's static KV cache and its sizing rule.

    k, v: (L, B, H_kv, M, D) in the model dtype, zero-filled once (garbage slots stay finite, so a
    masked key contributes 0 · V = 0, never NaN), reused by every call with the same (B, M)
    `leading(b)`: the same cache restricted to rows [0, b), views of k and v made once and kept
    (a CUDA graph captured on them reads this storage; the loop's compaction moves the live rows
    there); layer i of a view, k[i], is contiguous like the full cache's

M = C + N + S for N new tokens, S = slack (the steps of the last captured group of decode steps
that run past N write into it) and a prompt room C: first the longest prompt this run has been
told of (`max_prompt_length`) or seen, rounded up to a multiple of PROMPT_ROUND. A longer prompt
grows C to max(P, GROWTH · C), rounded up, at most MAX_GROWTHS times per (batch, N); each growth
is logged, and allocates a new cache (and, on CUDA, captures a new graph for its shape). After
the last growth a prompt that does not fit is not sampled here (the caller falls back).
"""

from __future__ import annotations

import dataclasses
import math

import torch

PROMPT_ROUND = 16
GROWTH = 1.5
MAX_GROWTHS = 2


def prompt_room(prompt_len: int, previous: int = 0) -> int:
    """max(prompt_len, GROWTH · previous) rounded up to a multiple of PROMPT_ROUND."""
    want = max(prompt_len, math.ceil(GROWTH * previous))
    return -(-want // PROMPT_ROUND) * PROMPT_ROUND


@dataclasses.dataclass
class KVCache:
    k: torch.Tensor  # (L, B, H_kv, M, D)
    v: torch.Tensor
    room: int  # C: prompt tokens it holds
    new_tokens: int  # N
    growths: int
    views: dict = dataclasses.field(default_factory=dict, repr=False)  # b -> KVCache of rows [0, b)

    @classmethod
    def allocate(cls, config, *, batch, room, new_tokens, slack, growths, dtype, device):
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // \
            config.num_attention_heads
        shape = (config.num_hidden_layers, batch, heads, room + new_tokens + slack, head_dim)
        k = torch.zeros(shape, dtype=dtype, device=device)  # L·B·H_kv·M·D elements each
        return cls(k, torch.zeros_like(k), room, new_tokens, growths)

    def leading(self, b: int) -> KVCache:
        view = self.views.get(b)
        if view is None:
            view = self.views[b] = KVCache(self.k[:, :b], self.v[:, :b], self.room,
                                           self.new_tokens, self.growths)
        return view

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
