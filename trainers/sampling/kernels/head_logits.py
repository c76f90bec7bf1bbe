"""A decode step's LM head: the logits of a few rows, with no cuBLAS call in the captured step.

For x (B, H) and the head weight W (V, H), both of one 16-bit dtype:

    z_bv = fp32( round_dtype( Σ_h x_bh · W_vh ) )        (B, V) fp32

the module's output in its dtype, then fp32: what `head(x).float()` gives (HF's `generate` takes
its logits the same way). The products of 16-bit values are exact in fp32 and the sum is fp32,
as cuBLAS's; only the order of the sum differs, so z is cuBLAS's value or a neighbour of it in
the dtype (one ulp apart where the fp32 sums straddle a rounding boundary).

Why not cuBLAS: a cuBLAS call inside a captured graph keeps a cuBLAS workspace allocated for the
capture stream for as long as the process lives, on top of the one training uses.

Grid (cdiv(B, BLOCK_B), cdiv(V, BLOCK_V)): each program computes one (BLOCK_V, BLOCK_B) tile
(W is the wide operand of the dot; the rows of x come from L2), so W is read once from HBM at
decode batches (B ≤ BLOCK_B) and the logits are written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interp import dot, interpreting, to_dtype
from .pdl import grid_wait, launch_args

HEAD_DTYPES = (torch.bfloat16, torch.float16)
BLOCK_V = 128
BLOCK_H = 128
MAX_BLOCK_B = 64


@triton.jit
def _head_logits_kernel(x_ptr, stride_x, w_ptr, stride_w, z_ptr, stride_z, B, V, H,
                        EVEN_H: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_B: tl.constexpr,
                        BLOCK_H: tl.constexpr, PDL: tl.constexpr, INTERP: tl.constexpr):
    grid_wait(PDL)  # kernels.pdl: launched early, this kernel reads nothing before it
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_b = offs_b < B
    in_v = offs_v < V
    x_rows = x_ptr + offs_b.to(tl.int64)[None, :] * stride_x  # (1, BLOCK_B)
    w_rows = w_ptr + offs_v.to(tl.int64)[:, None] * stride_w  # (BLOCK_V, 1)
    acc = tl.zeros((BLOCK_V, BLOCK_B), tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        if EVEN_H:
            w = tl.load(w_rows + hh[None, :], mask=in_v[:, None], other=0.0)
            x = tl.load(x_rows + hh[:, None], mask=in_b[None, :], other=0.0)
        else:
            w = tl.load(w_rows + hh[None, :], mask=in_v[:, None] & (hh < H)[None, :], other=0.0)
            x = tl.load(x_rows + hh[:, None], mask=in_b[None, :] & (hh < H)[:, None], other=0.0)
        acc += dot(w, x, INTERP)
    z = to_dtype(acc, w_ptr.dtype.element_ty, INTERP).to(tl.float32)
    out = z_ptr + offs_b.to(tl.int64)[None, :] * stride_z + offs_v[:, None]
    tl.store(out, z, mask=in_v[:, None] & in_b[None, :])


def head_reason(head, dtype: torch.dtype) -> str | None:
    """Why `head_logits` does not serve output embeddings `head` for inputs of `dtype`, or None."""
    if type(head) is not torch.nn.Linear:
        return f"the LM head is a {type(head).__name__}, not a plain nn.Linear"
    if head.bias is not None:
        return "the LM head has a bias"
    w = head.weight
    if w.dtype not in HEAD_DTYPES or w.dtype != dtype:
        return f"the LM head weight is {w.dtype} for {dtype} inputs"
    if w.dim() != 2 or w.stride(1) != 1:
        return "the LM head weight's rows are not contiguous"
    return None


def head_logits(x: torch.Tensor, head: torch.nn.Linear) -> torch.Tensor:
    """(B, V) fp32 of the module docstring for x (B, H) and `head` (one `head_reason` accepts)."""
    w = head.weight
    if x.dim() != 2 or x.shape[1] != w.shape[1] or x.dtype != w.dtype:
        raise ValueError(f"x has shape {tuple(x.shape)} {x.dtype}; the LM head takes "
                         f"(B, {w.shape[1]}) {w.dtype}")
    x = x if x.stride(1) == 1 else x.contiguous()
    B, H = x.shape
    V = w.shape[0]
    z = torch.empty(B, V, device=x.device, dtype=torch.float32)
    block_b = min(MAX_BLOCK_B, max(16, triton.next_power_of_2(B)))
    grid = (triton.cdiv(B, block_b), triton.cdiv(V, BLOCK_V))
    _head_logits_kernel[grid](x, x.stride(0), w, w.stride(0), z, z.stride(0), B, V, H,
                              EVEN_H=H % BLOCK_H == 0, BLOCK_V=BLOCK_V, BLOCK_B=block_b,
                              BLOCK_H=BLOCK_H, INTERP=interpreting(), num_warps=4,
                              **launch_args(_head_logits_kernel, x.device),
                              num_stages=4)
    return z
