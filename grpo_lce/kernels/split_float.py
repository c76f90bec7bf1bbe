"""fp32 values kept in 3 bytes: a bf16 array (each value's upper 16 bits) and a uint8 array (the
next 8), 15 of fp32's 23 mantissa bits. Joining them back gives the fp32 value truncated at bit 8:
relative error < 2^-15, exact for 0, ±inf and NaN.

Why: the fused loop's gradient basis (N, H) is saved from the forward for the backward. In fp32
it costs 4 N H bytes (256 MiB for llama-8b's 16384 x 4096 call); in bf16, which the same rows
of the gathered hidden states could hold for free (grpo_lce/_head), dh = g · basis would be
rounded twice, once when the basis is stored and once when dh is cast (2^-8 relative each):
about twice the error of one rounding, enough to put dh above the error of the bf16-logit paths
(torch's, TRL's) that this library must beat. The bf16 half goes over those rows and the uint8
half costs N H bytes: 3 bytes a value, dh rounded once, as from fp32 (the truncation's < 2^-15
is far below that one rounding).

The bf16 half alone is the value truncated to bf16 (not rounded): only `join` reads it.
"""

from __future__ import annotations

import torch

from grpo_lce.kernels._triton import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def store_split(hi_ptrs, lo_ptrs, val, mask):
        """Store fp32 `val` as its upper 16 bits at hi_ptrs (bf16) and the next 8 at lo_ptrs."""
        bits = val.to(tl.uint32, bitcast=True)
        tl.store(hi_ptrs, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        tl.store(lo_ptrs, ((bits >> 8) & 0xFF).to(tl.uint8), mask=mask)

    @triton.jit
    def store_f32(ptrs, lo_ptrs, val, mask, SPLIT: tl.constexpr):
        """Store fp32 `val` at ptrs (fp32), or split over ptrs (bf16) and lo_ptrs when SPLIT:
        the two formats of the gradient basis (fp32 unfused, 3 bytes fused)."""
        if SPLIT:
            store_split(ptrs, lo_ptrs, val, mask)
        else:
            tl.store(ptrs, val, mask=mask)

    @triton.jit
    def load_split(hi_ptrs, lo_ptrs, mask):
        """The fp32 values of store_split (0 where masked)."""
        hi = tl.load(hi_ptrs, mask=mask, other=0.0).to(tl.uint16, bitcast=True).to(tl.uint32)
        lo = tl.load(lo_ptrs, mask=mask, other=0).to(tl.uint32)
        return ((hi << 16) | (lo << 8)).to(tl.float32, bitcast=True)


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi bf16, lo uint8) of an fp32 tensor, as store_split writes them (tests, torch paths)."""
    b = x.contiguous().view(torch.uint8).view(*x.shape, 4)  # little-endian bytes
    return b[..., 2:].contiguous().view(torch.bfloat16).squeeze(-1), b[..., 1].contiguous()


def join(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """fp32 (hi's shape) from a bf16 hi and a uint8 lo, as load_split reads them."""
    b = torch.zeros(*hi.shape, 4, device=hi.device, dtype=torch.uint8)
    b[..., 1] = lo
    b[..., 2:] = hi.contiguous().view(torch.uint8).view(*hi.shape, 2)
    return b.view(torch.float32).squeeze(-1)
