"""The per-row terms around the fused loop's cuBLAS GEMMs 2 and 3 (grpo_lce._head).

For the k valid rows of a chunk, x (k, H) bf16, factor f (k,), α (k,) (None: 1), targets y:

    basis_i = f_i · (G' W)_i − α_i · W[y_i]      from GEMM 2's fp32 output      } one kernel:
    xf_i    = bf16(f_i · x_i)                     GEMM 3's operand               } finish_basis...
    dW[y_i] −= α_i · x_i                          the e_y part of dW (atomics)     scatter_target

so that basis = α (p − e_y) W and dW += α (p − e_y)ᵀ X. In torch ops these are eight launches
and passes per chunk (mul, index_select, addcmul, mul, cast, cast, mul, index_add); here two,
each reading its rows once. `scatter_target` adds in fp32 with atomics, as torch's CUDA
index_add does (rows sharing a target add in no fixed order).
"""

from __future__ import annotations

import torch

from grpo_lce.kernels._triton import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from grpo_lce.kernels._tma_common import round_to_bf16
    from grpo_lce.kernels.split_float import store_f32

    @triton.jit
    def _target_and_alpha(y_ptr, a_ptr, rows, rmask, HAS_ALPHA: tl.constexpr):
        """(y_i, α_i) of the block's rows as (BR, 1) columns; α = 1 without an α tensor."""
        y = tl.load(y_ptr + rows, mask=rmask, other=0)[:, None]
        if HAS_ALPHA:
            a = tl.load(a_ptr + rows, mask=rmask, other=0.0)
        else:
            a = tl.where(rmask, 1.0, 0.0)
        return y, a[:, None]

    @triton.jit
    def _finish_basis_kernel(
        gw_ptr, basis_ptr, lo_ptr, f_ptr, a_ptr, y_ptr, w_ptr, xf_ptr, x_ptr, k, H,
        stride_gw, stride_b, stride_lo, stride_w, stride_xf, stride_x,
        HAS_ALPHA: tl.constexpr, WANT_BASIS: tl.constexpr, SPLIT: tl.constexpr,
        WANT_XF: tl.constexpr,
        ROUND_BF16: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
    ):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = rows < k
        r64 = rows[:, None].to(tl.int64)
        f = tl.load(f_ptr + rows, mask=rmask, other=0.0)[:, None]
        if WANT_BASIS:
            y, a = _target_and_alpha(y_ptr, a_ptr, rows, rmask, HAS_ALPHA)
        for h0 in range(0, H, BH):
            cols = h0 + tl.arange(0, BH)[None, :]
            m2 = rmask[:, None] & (cols < H)
            if WANT_BASIS:
                gw = tl.load(gw_ptr + r64 * stride_gw + cols, mask=m2, other=0.0)
                wy = tl.load(w_ptr + y * stride_w + cols, mask=m2, other=0.0).to(tl.float32)
                store_f32(basis_ptr + r64 * stride_b + cols, lo_ptr + r64 * stride_lo + cols,
                          f * gw - a * wy, m2, SPLIT)
            if WANT_XF:
                xf = f * tl.load(x_ptr + r64 * stride_x + cols, mask=m2, other=0.0).to(tl.float32)
                if ROUND_BF16:  # the interpreter's cast truncates (see round_to_bf16)
                    xf = round_to_bf16(xf)
                tl.store(xf_ptr + r64 * stride_xf + cols, xf.to(xf_ptr.dtype.element_ty), mask=m2)

    @triton.jit
    def _scatter_target_kernel(
        dw_ptr, x_ptr, a_ptr, y_ptr, k, H, stride_dw, stride_x,
        HAS_ALPHA: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
    ):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = rows < k
        y, a = _target_and_alpha(y_ptr, a_ptr, rows, rmask, HAS_ALPHA)
        for h0 in range(0, H, BH):
            cols = h0 + tl.arange(0, BH)[None, :]
            m2 = rmask[:, None] & (cols < H)
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols, mask=m2,
                        other=0.0).to(tl.float32)
            tl.atomic_add(dw_ptr + y * stride_dw + cols, -a * x, mask=m2, sem="relaxed")


_BR, _BH = 16, 256


def finish_basis_and_scale_rows(
    x: torch.Tensor, factor: torch.Tensor, y: torch.Tensor, w: torch.Tensor, *,
    alpha: torch.Tensor | None = None, gw: torch.Tensor | None = None,
    basis: torch.Tensor | None = None, basis_lo: torch.Tensor | None = None,
    want_xf: bool = False,
) -> torch.Tensor | None:
    """For the k rows x (k, H) with factors f (k,), targets y (k,), α (k,) (None: 1), and w
    (V, H) (unit column stride):

    with `gw` (k, H), GEMM 2's fp32 output: basis (k, H) = f ∘ gw − α ∘ W[y], written fp32 into
    `basis` (which may be gw itself), or with `basis_lo` (k, H) uint8 split over a bf16 `basis`
    and basis_lo (kernels/split_float; the bf16 half may be rows of x when want_xf is False);
    with `want_xf`: returns xf = f ∘ x in x's dtype (module docstring), else None."""
    k, H = x.shape
    xf = torch.empty_like(x) if want_xf else None
    if k == 0 or (gw is None and not want_xf):
        return xf
    want_basis, split = gw is not None, basis_lo is not None
    _finish_basis_kernel[(triton.cdiv(k, _BR),)](
        gw if want_basis else x, basis if want_basis else x, basis_lo if split else x, factor,
        alpha if alpha is not None else factor, y, w, xf if want_xf else x, x, k, H,
        gw.stride(0) if want_basis else 0, basis.stride(0) if want_basis else 0,
        basis_lo.stride(0) if split else 0, w.stride(0), xf.stride(0) if want_xf else 0,
        x.stride(0),
        HAS_ALPHA=alpha is not None, WANT_BASIS=want_basis, SPLIT=split, WANT_XF=want_xf,
        ROUND_BF16=x.dtype == torch.bfloat16 and not x.is_cuda, BR=_BR, BH=_BH, num_warps=4,
    )
    return xf


def scatter_target(grad_w: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor | None,
                   y: torch.Tensor) -> None:
    """grad_w (V, H) fp32 [y_i] −= α_i x_i for the k rows of x (k, H) (module docstring)."""
    k, H = x.shape
    if k == 0:
        return
    _scatter_target_kernel[(triton.cdiv(k, _BR),)](
        grad_w, x, alpha if alpha is not None else grad_w, y, k, H, grad_w.stride(0),
        x.stride(0), HAS_ALPHA=alpha is not None, BR=_BR, BH=_BH, num_warps=4,
    )
