"""Rows into and out of the device-counted layout of a call (grpo_lce._rows), one pass each.

order (N,) int64: the caller's row held at each position (valid rows first), m = n_valid (an
int32 (1,) device tensor, never read on the host).

    gather    x[i] = t[order[i]]  for i < m,   0 for i >= m                  (N, H), t's dtype
    scatter   d[order[i]] = (a_i u_i + b_i v_i).to(dtype)  for i < m,  0 for i >= m
              a_i = s_u · w_u[order[i]] (w_u per caller row) or s_u · w_u (a 0-dim w_u); b alike

`gather` brings the hidden states into the layout (the rows past m zero, so a NaN in an ignored
row never reaches a GEMM); `scatter` takes the (N, H) fp32 gradient bases back to the caller's
rows, scaled by the upstream gradient, in the hidden dtype. Every position is written once
(order is a permutation), so no zero fill and no atomics. In torch ops each is 2-4 passes
(index_select, where; mul, add, cast, index_copy) and, around an autograd Function, their
backward passes too (index_select's backward is a bf16 index_add).
"""

from __future__ import annotations

import torch

from grpo_lce.kernels._triton import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from grpo_lce.kernels._tma_common import round_to_bf16
    from grpo_lce.kernels.split_float import load_split

    @triton.jit
    def _gather_rows_kernel(
        t_ptr, order_ptr, n_valid_ptr, out_ptr, N, H, stride_tn, stride_th, stride_on,
        BR: tl.constexpr, BH: tl.constexpr,
    ):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        inside = rows < N
        valid = rows < tl.load(n_valid_ptr)
        src = tl.load(order_ptr + rows, mask=valid, other=0)
        for h0 in range(0, H, BH):
            cols = h0 + tl.arange(0, BH)
            cmask = cols[None, :] < H
            x = tl.load(t_ptr + src[:, None] * stride_tn + cols[None, :] * stride_th,
                        mask=valid[:, None] & cmask, other=0.0)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_on + cols[None, :], x,
                     mask=inside[:, None] & cmask)

    @triton.jit
    def _row_weight(w_ptr, dst, valid, s, W_KIND: tl.constexpr):
        # a_i = s · w[order[i]] (W_KIND 2), s · w (1) or s (0); 0 past the valid rows
        if W_KIND == 2:
            w = tl.load(w_ptr + dst, mask=valid, other=0.0).to(tl.float32) * s
        elif W_KIND == 1:
            w = tl.load(w_ptr).to(tl.float32) * s
        else:
            w = s
        return tl.where(valid, w, 0.0)

    @triton.jit
    def _scatter_rows_kernel(
        u_ptr, ulo_ptr, wu_ptr, su, v_ptr, wv_ptr, sv, order_ptr, n_valid_ptr, out_ptr,
        N, H, stride_un, stride_ulo, stride_vn, stride_on,
        U_SPLIT: tl.constexpr, WU_KIND: tl.constexpr, HAS_V: tl.constexpr,
        WV_KIND: tl.constexpr,
        ROUND_BF16: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
    ):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        inside = rows < N
        valid = rows < tl.load(n_valid_ptr)
        dst = tl.load(order_ptr + rows, mask=inside, other=0)
        a = _row_weight(wu_ptr, dst, valid, su, WU_KIND)
        if HAS_V:
            b = _row_weight(wv_ptr, dst, valid, sv, WV_KIND)
        r64 = rows[:, None].to(tl.int64)
        for h0 in range(0, H, BH):
            cols = h0 + tl.arange(0, BH)
            cmask = cols[None, :] < H
            # loads masked to the valid rows: a NaN basis row past them still gives 0
            lmask = valid[:, None] & cmask
            if U_SPLIT:  # fp32 kept in 3 bytes (kernels/split_float)
                acc = load_split(u_ptr + r64 * stride_un + cols[None, :],
                                 ulo_ptr + r64 * stride_ulo + cols[None, :], lmask)
            else:
                acc = tl.load(u_ptr + r64 * stride_un + cols[None, :], mask=lmask, other=0.0)
            acc = acc * a[:, None]
            if HAS_V:
                v = tl.load(v_ptr + r64 * stride_vn + cols[None, :], mask=lmask, other=0.0)
                acc += v * b[:, None]
            if ROUND_BF16:  # the interpreter's cast truncates (see round_to_bf16)
                acc = round_to_bf16(acc)
            tl.store(out_ptr + dst[:, None] * stride_on + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=inside[:, None] & cmask)


_BR, _BH = 16, 256  # 16 rows x 256 columns a step: 16 KB of fp32 in flight per program


def gather_rows(t: torch.Tensor, order: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """x (N, H) contiguous in t's dtype: x[i] = t[order[i]] below the device count n_valid,
    0 from it on (module docstring). t (N, H) any strides; order (N,) int64."""
    N, H = t.shape
    out = torch.empty(N, H, device=t.device, dtype=t.dtype)
    if N == 0:
        return out
    _gather_rows_kernel[(triton.cdiv(N, _BR),)](
        t, order, n_valid, out, N, H, t.stride(0), t.stride(1), out.stride(0),
        BR=_BR, BH=_BH, num_warps=4,
    )
    return out


def _kind(w: torch.Tensor | None) -> int:
    return 0 if w is None else 1 if w.dim() == 0 else 2


def scatter_rows(
    u: torch.Tensor, w_u: torch.Tensor | None, order: torch.Tensor, n_valid: torch.Tensor,
    dtype: torch.dtype, *, s_u: float = 1.0, v: torch.Tensor | None = None,
    w_v: torch.Tensor | None = None, s_v: float = 1.0, u_lo: torch.Tensor | None = None,
) -> torch.Tensor:
    """d (N, H) in `dtype`, d[order[i]] = a_i u[i] + b_i v[i] (module docstring). u, v (N, H)
    fp32, contiguous rows, or u split in 3 bytes: bf16 u and uint8 `u_lo` (kernels/split_float);
    w_u, w_v (N,) per caller row (contiguous), 0-dim, or None (1)."""
    N, H = u.shape
    out = torch.empty(N, H, device=u.device, dtype=dtype)
    if N == 0:
        return out
    has_v = v is not None
    _scatter_rows_kernel[(triton.cdiv(N, _BR),)](
        u, u if u_lo is None else u_lo, u if w_u is None else w_u, s_u, v if has_v else u,
        u if w_v is None else w_v, s_v, order, n_valid, out,
        N, H, u.stride(0), 0 if u_lo is None else u_lo.stride(0),
        v.stride(0) if has_v else 0, out.stride(0),
        U_SPLIT=u_lo is not None, WU_KIND=_kind(w_u), HAS_V=has_v, WV_KIND=_kind(w_v),
        ROUND_BF16=dtype == torch.bfloat16 and not u.is_cuda, BR=_BR, BH=_BH, num_warps=4,
    )
    return out
