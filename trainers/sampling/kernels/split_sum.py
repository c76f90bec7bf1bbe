"""A projection's output handed on as its K splits' partial sums, for the next kernel to finish.

A decode linear whose K loop is split over S programs (`linear4bit`, SPLIT_K > 1) forms each
output element as

    y = round_dtype(((0 + P_0) + P_1) + ... + P_{S-1} + bias)        (fp32 sums, one rounding)

with P_s the fp32 partial of split s. Summing inside the linear costs a tail on its critical path:
every program stores its partial and takes an arrival counter (a release and an acquire through
L2), and the last one to arrive reads the others' partials back and stores y. The kernel that
reads y next (`add_rmsnorm` after o_proj and down_proj, `rope_cache_write` after q/k/v) can read
the S partials in its place and sum them itself: the same additions in the same order and the
same rounding, so the same bits of y, and the linear's programs end with their partial's store.

`SplitSum` is that unfinished output; `load_sum` is the consumers' read of it (or of a plain
tensor, SPLITS = 0); `materialize` is the same sum in torch ops (the consumers' CPU path and the
tests' reference). `CONSUMED` counts the SplitSums each consumer took (tests assert the path ran).
"""

from __future__ import annotations

import collections
import dataclasses

import torch
import triton
import triton.language as tl

from ..kernels._interp import to_dtype

CONSUMED: collections.Counter = collections.Counter()  # consumer name -> SplitSums it summed


@dataclasses.dataclass(frozen=True)
class SplitSum:
    """y (`shape`) in `dtype` = round(Σ_s parts[s] + bias) (module docstring): parts (S, *shape)
    fp32 with a unit-stride last dim, bias (n,) or None, n the projection's output features
    (shape[-1], or the product of the trailing dims a `view` split it into)."""

    parts: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype
    n: int

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    @property
    def splits(self) -> int:
        return self.parts.shape[0]

    @property
    def device(self) -> torch.device:
        return self.parts.device

    def dim(self) -> int:
        return self.parts.dim() - 1

    def view(self, *shape) -> SplitSum:
        """The same output seen as `shape` (torch.view semantics on each split's partial)."""
        return dataclasses.replace(self, parts=self.parts.view(self.splits, *shape))

    reshape = view

    def materialize(self) -> torch.Tensor:
        """y as a tensor: the sum in split order, then the bias, in fp32, rounded once."""
        flat = self.parts.reshape(self.splits, -1, self.n)
        acc = torch.zeros(flat.shape[1:], dtype=torch.float32, device=self.device)
        for s in range(self.splits):
            acc = acc + flat[s]
        if self.bias is not None:
            acc = acc + self.bias.to(torch.float32)
        return acc.to(self.dtype).view(self.shape)


def kernel_args(t: torch.Tensor | SplitSum, flat_shape: tuple) -> tuple:
    """(tensor to read, split stride, bias or None, SPLITS) of a consumer's input `t` seen as
    `flat_shape`: a tensor reshaped (SPLITS 0), a SplitSum's first partial (its others follow
    at the split stride)."""
    if isinstance(t, SplitSum):
        parts = t.parts.reshape(t.splits, *flat_shape)
        return parts[0], parts.stride(0), t.bias, t.splits
    return t.reshape(flat_shape), 0, None, 0


@triton.jit
def load_sum(ptrs, mask, stride_s, bias_ptrs, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
             DT: tl.constexpr, INTERP: tl.constexpr):
    """fp32 values of y at `ptrs`: the elements themselves (SPLITS 0), else round_DT of the
    partials at ptrs + s · stride_s summed from zero in split order, plus the bias at bias_ptrs
    (the module docstring's sum, as the linear's last program forms it)."""
    if SPLITS == 0:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros(ptrs.shape, dtype=tl.float32)
        for s in tl.static_range(SPLITS):  # every load issued before the first add needs it
            acc += tl.load(ptrs + s * stride_s, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            acc += tl.load(bias_ptrs, mask=mask, other=0.0).to(tl.float32)
        return to_dtype(acc, DT, INTERP).to(tl.float32)
