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

With LoRA factors A_j (`lora_a`: the q/k/v or gate/up projections that read y) the row's
columns are split over P programs (`kernels.lora_t`): each computes the row's mean square
(the whole row), writes r' and y of its columns and part p of t_j = y @ A_jᵀ over them, so
the linear after it sums t instead of forming it in every tile. Extra memory: the factors'
columns read once a row, t's P·J·R·M fp32 parts written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels._interp import interpreting, to_dtype
from .lora_t import PARTS, LoraT, check_factors, lora_t_torch
from .pdl import grid_wait, launch_args, let_next_launch, next_at_start
from .split_sum import CONSUMED, SplitSum, kernel_args, load_sum

# norms whose forward is LlamaRMSNorm's (fp32 statistics, cast, then weight ·), read by name so
# that transformers need not be imported here
LLAMA_STYLE_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


@triton.jit
def _residual_sum(x_ptr, r_ptr, xb_ptr, ids_ptr, row, offs, mask, V, stride_x, stride_r,
                  stride_xs, X_DT: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                  X_SPLITS: tl.constexpr, HAS_XBIAS: tl.constexpr, GATHER: tl.constexpr,
                  INTERP: tl.constexpr):
    """r' at columns `offs` of `row` (fp32 of X_DT values): x's (a SplitSum's sum, or the
    gathered table row) plus the residual, rounded as torch's add. The same bits wherever it
    is called: each element's ops do not depend on the others'."""
    if GATHER:
        x_row = tl.load(ids_ptr + row + offs * 0).to(tl.int64)  # every lane the row's id
        x_mask = mask & (x_row >= 0) & (x_row < V)
    else:
        x_row = row
        x_mask = mask
    s = load_sum(x_ptr + x_row * stride_x + offs, x_mask, stride_xs, xb_ptr + offs, X_SPLITS,
                 HAS_XBIAS, X_DT, INTERP)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        s = to_dtype(s + r, X_DT, INTERP).to(tl.float32)  # r', as torch's bf16 add
    return s


@triton.jit
def _factor_tile(a0_ptr, a1_ptr, a2_ptr, stride_a0, stride_a1, stride_a2, cols, col_ok,
                 N_A: tl.constexpr, RANK: tl.constexpr, BLOCK_R: tl.constexpr):
    """The factors' columns `cols` stacked (BLOCK_R, BLOCK_P) bf16: row j·RANK + r is A_j's
    row r (zeros past N_A·RANK rows and past H), so one reduction forms every factor's t."""
    rows = tl.arange(0, BLOCK_R)
    j = rows // RANK
    r = (rows % RANK).to(tl.int64)
    ptr = tl.where(j == 0, a0_ptr + r * stride_a0,
                   tl.where(j == 1, a1_ptr + r * stride_a1, a2_ptr + r * stride_a2))
    return tl.load(ptr[:, None] + cols[None, :], mask=(rows < N_A * RANK)[:, None]
                   & col_ok[None, :], other=0.0)


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, rout_ptr, xb_ptr, ids_ptr, a0_ptr, a1_ptr, a2_ptr, t_ptr,
    H, V, eps,
    stride_x, stride_r, stride_y, stride_ro, stride_xs, stride_a0, stride_a1, stride_a2,
    stride_tp, stride_tr,
    HAS_RESIDUAL: tl.constexpr, X_SPLITS: tl.constexpr, HAS_XBIAS: tl.constexpr,
    GATHER: tl.constexpr, BLOCK_H: tl.constexpr, N_A: tl.constexpr, RANK: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr, INTERP: tl.constexpr,
    NEXT_AT_START: tl.constexpr = False,
):
    """Program (row, p): the row's mean square over all H columns, then r' and y of its columns
    p·BLOCK_P .. (p + 1)·BLOCK_P - 1 (BLOCK_P = BLOCK_H: one program a row, the whole row) and,
    with N_A factors A_j, part p of LoRA's t over those columns (`lora_t`). Without a split
    (one program a row) the whole row is loaded before r' is stored, so rout may be r.
    X_SPLITS > 0: x is a `split_sum.SplitSum`, its partials at x_ptr + s · stride_xs and its
    bias at xb_ptr (HAS_XBIAS), summed here (`load_sum`) into x's values; x's dtype is then
    rout's (a SplitSum comes with a residual). GATHER: x is an embedding table of V rows, the
    row's x is its row ids[row] (zeros for an id outside [0, V): no read out of the table),
    stored to rout as r' (no residual)."""
    let_next_launch(NEXT_AT_START)  # kernels.pdl: the next kernel may launch now
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    cols = p * BLOCK_P + tl.arange(0, BLOCK_P)
    col_ok = cols < H
    if N_A > 0:  # the factors' columns of this part: no kernel's output, read before the wait
        a = _factor_tile(a0_ptr, a1_ptr, a2_ptr, stride_a0, stride_a1, stride_a2, cols,
                         col_ok, N_A, RANK, BLOCK_R)
    grid_wait(PDL)  # kernels.pdl: launched early, this kernel reads nothing else before it
    X_DT: tl.constexpr = rout_ptr.dtype.element_ty  # x's dtype (rout is x without a residual)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    s = _residual_sum(x_ptr, r_ptr, xb_ptr, ids_ptr, row, offs, mask, V, stride_x, stride_r,
                      stride_xs, X_DT, HAS_RESIDUAL, X_SPLITS, HAS_XBIAS, GATHER, INTERP)
    if BLOCK_P < BLOCK_H:  # this part's columns again (the same values: `_residual_sum`),
        # loaded beside the row rather than after its reduction
        s_p = _residual_sum(x_ptr, r_ptr, xb_ptr, ids_ptr, row, cols, col_ok, V, stride_x,
                            stride_r, stride_xs, X_DT, HAS_RESIDUAL, X_SPLITS, HAS_XBIAS,
                            GATHER, INTERP)
    else:
        s_p, cols, col_ok = s, offs, mask
    var = tl.sum(s * s, axis=0) / H  # masked lanes are 0
    if HAS_RESIDUAL or GATHER:  # r' (with GATHER the looked-up row: s holds X_DT values)
        tl.store(rout_ptr + row * stride_ro + cols, s_p.to(X_DT), mask=col_ok)
    n = to_dtype(s_p * tl.rsqrt(var + eps), X_DT, INTERP).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = to_dtype(w * n, y_ptr.dtype.element_ty, INTERP)
    tl.store(y_ptr + row * stride_y + cols, y, mask=col_ok)
    if N_A > 0:  # T[p, j·RANK + r, row] = Σ_k A_j[r, k] · y_k over the part, from y as the
        # linear reads it (rounded; zeros past H): one reduction for every factor
        t = tl.sum(a.to(tl.float32) * tl.where(col_ok, y.to(tl.float32), 0.0)[None, :], axis=1)
        rows = tl.arange(0, BLOCK_R)
        tl.store(t_ptr + p * stride_tp + rows * stride_tr + row, t, mask=rows < N_A * RANK)


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


def t_warps(block_p: int) -> int:
    """Warps of a program that also forms LoRA's t over BLOCK_P columns: one warp a 32
    columns, 4 to 16 (the product's sum over the columns crosses fewer warps than at
    `norm_warps`' 32; bench/README.md has the measured grid)."""
    return min(16, max(4, block_p // 32))


def add_rmsnorm(x: torch.Tensor | SplitSum, residual: torch.Tensor | None,
                weight: torch.Tensor, eps: float, *, residual_out: torch.Tensor | None = None,
                ids: torch.Tensor | None = None, lora_a: tuple | None = None):
    """(y, r') for x (..., H): r' = residual + x (x itself if residual is None), y = the
    LlamaRMSNorm of r' with `weight` and `eps` (module docstring). `residual_out` receives r'
    (it may be `residual`, for an in-place update; with `ids`, the looked-up rows). x may be a
    projection's `split_sum.SplitSum` (with a residual): its partials are summed here, the same
    bits as the projection's own sum. `ids` (any shape, integer): x is an embedding table
    (V, H) and the input is its rows x[ids] (the lookup in the same launch; no residual): y and
    r' = x[ids] then have shape ids.shape + (H,). `lora_a` (1 to 3 LoRA factors (R, H) of the
    projections that read y, as q/k/v or gate/up): returns (y, r', `lora_t.LoraT` of y and those
    factors) for the decode linear to take t from; r' then goes to a new tensor (not
    `residual_out`: the programs that split a row read the residual whole), and the mean
    square is summed in another order (`t_warps`), within the same bound. Triton on CUDA and
    under the interpreter, the torch ops elsewhere."""
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
    if lora_a is not None:
        lora_a = tuple(lora_a)
        check_factors(lora_a, h, x.device)
        if residual_out is not None:
            raise ValueError("lora_a with residual_out: the programs that split a row read the "
                             "residual whole, so r' goes to a new tensor")
    if not (x.device.type == "cuda" or interpreting()):
        if isinstance(x, SplitSum):
            x = x.materialize()
        if ids is not None:
            x = x[ids]
        y, r_new = add_rmsnorm_torch(x, residual, weight, eps)
        if residual_out is not None and (residual is not None or ids is not None):
            residual_out.copy_(r_new)
            r_new = residual_out
        if lora_a is not None:
            return y, r_new, LoraT(lora_t_torch(y, lora_a), lora_a, y.data_ptr())
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
    n_a, parts, block_p, t = 0, 1, block_h, y  # t: never written without factors
    a = (weight,) * 3  # stand-ins, never read
    if lora_a is not None:
        n_a, a = len(lora_a), lora_a + (lora_a[-1],) * (3 - len(lora_a))
        # PARTS programs a row, each a power-of-two slice of the columns
        block_p = max(16, triton.next_power_of_2(triton.cdiv(h, PARTS)))
        parts = triton.cdiv(h, block_p)
        t = torch.empty(parts, n_a * lora_a[0].shape[0], m, device=x.device,
                        dtype=torch.float32)  # (P, J·R, M): T of `lora_t`
    _add_rmsnorm_kernel[(m, parts)](
        x2, r2, weight, y, rout, x_bias if x_bias is not None else weight,
        ids_flat if ids_flat is not None else weight, *a, t, h, x2.shape[0], float(eps),
        x2.stride(0), r2.stride(0), y.stride(0), rout.stride(0), stride_xs,
        *(aj.stride(0) for aj in a), t.stride(0), t.stride(1) if lora_a is not None else 0,
        HAS_RESIDUAL=residual is not None, X_SPLITS=x_splits, HAS_XBIAS=x_bias is not None,
        GATHER=ids is not None, BLOCK_H=block_h, N_A=n_a,
        RANK=lora_a[0].shape[0] if lora_a is not None else 16,
        BLOCK_R=triton.next_power_of_2(n_a * lora_a[0].shape[0]) if lora_a is not None else 16,
        BLOCK_P=block_p,
        INTERP=interpreting(),
        num_warps=norm_warps(block_h) if lora_a is None else t_warps(block_p),
        **next_at_start(launch_args(_add_rmsnorm_kernel, x2.device)),
    )
    if ids is not None:
        r_new = residual_out if residual_out is not None else rout.view(out_shape)
    else:
        r_new = x if residual is None else (residual_out if residual_out is not None
                                            else rout.view(residual.shape))
    if lora_a is not None:
        return y.view(out_shape), r_new, LoraT(t, lora_a, y.data_ptr())
    return y.view(out_shape), r_new


def rmsnorm_params(norm: torch.nn.Module) -> tuple[torch.Tensor, float]:
    """(weight, eps) of a transformers norm whose forward is LlamaRMSNorm's; ValueError for
    others (Gemma's 1 + w, LayerNorm, ...), whose math differs."""
    name = type(norm).__name__
    if name not in LLAMA_STYLE_NORMS:
        raise ValueError(f"norm is {name}, expected one of {LLAMA_STYLE_NORMS}")
    return norm.weight, float(norm.variance_epsilon)
