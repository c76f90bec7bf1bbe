"""out = (t · g).to(dtype) for an fp32 tensor t and a 0-dim fp32 tensor g, in one pass.

The cross-entropy backward scales the gradients built in the forward by grad_output and returns
them in the parameters' dtype. torch's mixed-dtype `mul(t, g, out=bf16)` runs a non-vectorised
kernel, far from the bandwidth its traffic allows; this reads t once and writes the result
once, with g read on the device (no host sync) and one rounding.
"""

from __future__ import annotations

import torch

from grpo_lce.kernels._triton import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from grpo_lce.kernels._tma_common import round_to_bf16

    @triton.jit
    def _scale_cast_kernel(t_ptr, g_ptr, out_ptr, n, ROUND_BF16: tl.constexpr,
                           BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr)
        t = tl.load(t_ptr + offs, mask=mask, other=0.0) * g
        if ROUND_BF16:  # the interpreter's cast truncates (see round_to_bf16)
            t = round_to_bf16(t)
        tl.store(out_ptr + offs, t.to(out_ptr.dtype.element_ty), mask=mask)


def scale_cast(t: torch.Tensor, g: torch.Tensor, dtype: torch.dtype, *, backend: str
               ) -> torch.Tensor:
    """(t * g) in `dtype`; t fp32, g a 0-dim fp32 tensor on t's device. `backend` (the call's
    Path): "triton" runs the kernel above on a contiguous t, "torch" (or any other t) one
    mixed-dtype torch.mul."""
    if backend == "torch" or not t.is_contiguous() or t.numel() == 0:
        return torch.mul(t, g, out=torch.empty_like(t, dtype=dtype))
    out = torch.empty_like(t, dtype=dtype)
    BLOCK = 4096
    _scale_cast_kernel[(triton.cdiv(t.numel(), BLOCK),)](
        t, g, out, t.numel(), ROUND_BF16=dtype == torch.bfloat16 and not t.is_cuda,
        BLOCK=BLOCK, num_warps=8)
    return out
