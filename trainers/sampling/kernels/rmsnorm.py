"""RMSNorm with the residual add fused, in transformers' LlamaRMSNorm semantics.

x (M, H), residual r (M, H) in the model dtype (bf16), weight w (H,):

    r' = round(r + x)                                  (the decoder layer's bf16 residual add)
    n  = round(r' · (mean_h r'² + ε)^(-1/2))           (fp32, rounded to x's dtype)
    y  = round(w · n)                                  (in the promoted dtype of w and x)

which is `LlamaRMSNorm` (and Qwen2RMSNorm, Qwen3RMSNorm, MistralRMSNorm: the same forward)
applied to `residual + hidden_states`, as each decoder layer does twice. Returns (y, r').
Memory: one read of x, r and w, one write of y and r'; r' may overwrite r (`residual_out`).

Exactness: r' is bit for bit torch's (one fp32 add, one rounding). The mean and the inverse
square root differ from torch's only by fp32 summation order and the rsqrt's few fp32 ulps
(relative H · 2⁻²⁴ at most), which can move n across a bf16 rounding boundary: n is then one
bf16 ulp (≤ 2⁻⁷ |n|) off, and y ≤ (2⁻⁷ + 2 · 2⁻⁸)(1 + 2⁻⁷) |y| off. Elsewhere y equals torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels._interp import interpreting, to_dtype
from .pdl import grid_wait, launch_args
from .split_sum import CONSUMED, SplitSum, kernel_args, load_sum

# norms whose forward is LlamaRMSNorm's (fp32 statistics, cast, then weight ·), read by name so
# that transformers need not be imported here
LLAMA_STYLE_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, rout_ptr, xb_ptr, ids_ptr, H, V, eps,
    stride_x, stride_r, stride_y, stride_ro, stride_xs,
    HAS_RESIDUAL: tl.constexpr, X_SPLITS: tl.constexpr, HAS_XBIAS: tl.constexpr,
    GATHER: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr, INTERP: tl.constexpr,
):
    """One row per program: the whole row is loaded before r' is stored, so rout may be r.
    X_SPLITS > 0: x is a `split_sum.SplitSum`, its partials at x_ptr + s · stride_xs and its
    bias at xb_ptr (HAS_XBIAS), summed here (`load_sum`) into x's values; x's dtype is then
    rout's (a SplitSum comes with a residual). GATHER: x is an embedding table of V rows, the
    row's x is its row ids[row] (zeros for an id outside [0, V): no read out of the table),
    stored to rout as r' (no residual)."""
    grid_wait(PDL)  # kernels.pdl: launched early, this kernel reads nothing before it
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    X_DT: tl.constexpr = rout_ptr.dtype.element_ty  # x's dtype (rout is x without a residual)
    if GATHER:
        x_row = tl.load(ids_ptr + row + offs * 0).to(tl.int64)  # (BLOCK_H,), all lanes the id
        x_mask = mask & (x_row >= 0) & (x_row < V)
    else:
        x_row = row
        x_mask = mask
    s = load_sum(x_ptr + x_row * stride_x + offs, x_mask, stride_xs, xb_ptr + offs, X_SPLITS,
                 HAS_XBIAS, X_DT, INTERP)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        s = to_dtype(s + r, rout_ptr.dtype.element_ty, INTERP)  # r', as torch's bf16 add
        tl.store(rout_ptr + row * stride_ro + offs, s, mask=mask)
        s = s.to(tl.float32)
    elif GATHER:  # r' is the looked-up row itself (exact: s holds X_DT values)
        tl.store(rout_ptr + row * stride_ro + offs, s.to(X_DT), mask=mask)
    var = tl.sum(s * s, axis=0) / H  # masked lanes are 0
    n = to_dtype(s * tl.rsqrt(var + eps), X_DT, INTERP).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, to_dtype(w * n, y_ptr.dtype.element_ty, INTERP),
             mask=mask)


def add_rmsnorm_torch(x, residual, weight, eps):
    """The same in torch ops, as transformers' decoder layer and LlamaRMSNorm compute it."""
    r_new = x if residual is None else residual + x
    h = r_new.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    return weight * (h * torch.rsqrt(var + eps)).to(r_new.dtype), r_new


def norm_warps(block_h: int) -> int:
    """Warps of a row's program: 2 elements a thread, up to 32 warps. A row is one program, and
    with fewer threads its loads (a SplitSum's S partials each) queue behind each other. The
    layout sets the order of the fp32 sum of squares, so both inputs (a tensor, a SplitSum)
    take this one rule: the SplitSum path then gives the tensor path's bits."""
    return min(32, max(1, block_h // 64))


def add_rmsnorm(x: torch.Tensor | SplitSum, residual: torch.Tensor | None,
                weight: torch.Tensor, eps: float, *, residual_out: torch.Tensor | None = None,
                ids: torch.Tensor | None = None):
    """(y, r') for x (..., H): r' = residual + x (x itself if residual is None), y = the
    LlamaRMSNorm of r' with `weight` and `eps` (module docstring). `residual_out` receives r'
    (it may be `residual`, for an in-place update; with `ids`, the looked-up rows). x may be a
    projection's `split_sum.SplitSum` (with a residual): its partials are summed here, the same
    bits as the projection's own sum. `ids` (any shape, integer): x is an embedding table
    (V, H) and the input is its rows x[ids] (the lookup in the same launch; no residual): y and
    r' = x[ids] then have shape ids.shape + (H,). Triton on CUDA and under the interpreter, the
    torch ops elsewhere."""
    if isinstance(x, SplitSum) and residual is None:
        raise ValueError("x is a SplitSum: add_rmsnorm sums one only as the residual's delta")
    if ids is not None:
        if residual is not None or isinstance(x, SplitSum) or x.dim() != 2:
            raise ValueError(f"ids given: x must be an embedding table (V, H) and residual None "
                             f"(x {tuple(x.shape)}, residual "
                             f"{None if residual is None else tuple(residual.shape)})")
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"ids is {ids.dtype}, expected an integer tensor")
    h = x.shape[-1]
    if weight.shape != (h,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({h},) for x of "
                         f"shape {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual is {tuple(residual.shape)} {residual.dtype}, expected x's "
                         f"{tuple(x.shape)} {x.dtype}")
    if not (x.device.type == "cuda" or interpreting()):
        if isinstance(x, SplitSum):
            x = x.materialize()
        if ids is not None:
            x = x[ids]
        y, r_new = add_rmsnorm_torch(x, residual, weight, eps)
        if residual_out is not None and (residual is not None or ids is not None):
            residual_out.copy_(r_new)
            r_new = residual_out
        return y, r_new
    if isinstance(x, SplitSum):
        CONSUMED["add_rmsnorm"] += 1
    x2, stride_xs, x_bias, x_splits = kernel_args(x, (-1, h))  # (M, H), or the table (V, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    ids_flat = None if ids is None else ids.reshape(-1)
    m = x2.shape[0] if ids is None else ids_flat.numel()
    out_shape = (*(x.shape[:-1] if ids is None else ids.shape), h)
    y = torch.empty(m, h, device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
    if residual is None:
        r2 = x2  # never read (HAS_RESIDUAL=False)
        # r' is x itself (never written), or with ids the looked-up rows (written)
        if ids is None:
            rout = x2
        elif residual_out is not None:
            rout = residual_out.view(m, h)
        else:
            rout = torch.empty(m, h, device=x.device, dtype=x.dtype)
    else:
        r2 = residual.reshape(-1, h)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        rout = (residual_out.view(m, h) if residual_out is not None
                else torch.empty(m, h, device=x2.device, dtype=residual.dtype))
    block_h = triton.next_power_of_2(h)
    _add_rmsnorm_kernel[(m,)](
        x2, r2, weight, y, rout, x_bias if x_bias is not None else weight,
        ids_flat if ids_flat is not None else weight, h, x2.shape[0], float(eps),
        x2.stride(0), r2.stride(0), y.stride(0), rout.stride(0), stride_xs,
        HAS_RESIDUAL=residual is not None, X_SPLITS=x_splits, HAS_XBIAS=x_bias is not None,
        GATHER=ids is not None, BLOCK_H=block_h, INTERP=interpreting(),
        num_warps=norm_warps(block_h),
        **launch_args(_add_rmsnorm_kernel, x2.device),
    )
    if ids is not None:
        r_new = residual_out if residual_out is not None else rout.view(out_shape)
    else:
        r_new = x if residual is None else (residual_out if residual_out is not None
                                            else rout.view(residual.shape))
    return y.view(out_shape), r_new


def rmsnorm_params(norm: torch.nn.Module) -> tuple[torch.Tensor, float]:
    """(weight, eps) of a transformers norm whose forward is LlamaRMSNorm's; ValueError for
    others (Gemma's 1 + w, LayerNorm, ...), whose math differs."""
    name = type(norm).__name__
    if name not in LLAMA_STYLE_NORMS:
        raise ValueError(f"norm is {name}, expected one of {LLAMA_STYLE_NORMS}")
    return norm.weight, float(norm.variance_epsilon)
