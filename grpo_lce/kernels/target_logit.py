"""The target's logit of every row, in fp32 and base 2, before the fused GEMM 1 runs.

    zy₂_r = (x_r · W[y_r]) · log₂e / τ + b₂[y_r]          (the same formula as GEMM 1's epilogue)

One dot product of length H per row, fp32 accumulation of the bf16 products: N · H · 2 reads of
x and of the gathered W rows, one launch per call. It serves twice:
  - the log-prob's z_y (and the cross-entropy's), exact in fp32 like every other statistic; the
    sum runs in another order than the GEMM's, a difference of a few fp32 ulps of |z|;
  - the per-row shift c_r = zy₂_r + SHIFT2 of the G' operand (see gemm_softmax), needed before
    GEMM 1 starts.
Picking z_y out of GEMM 1's epilogue instead would cost it a compare, a select and a sum per
logit (to keep one column of each row), and the epilogue is where the fused GEMM's time beyond
the bare GEMM goes.
"""

from __future__ import annotations

import torch

from grpo_lce.kernels._triton import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _target_logit_kernel(
        x_ptr, stride_x, w_ptr, stride_w, y_ptr, b2_ptr, zy2_ptr, n_valid_ptr,
        N, H, scale2,
        HAS_BIAS: tl.constexpr, HAS_COUNT: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
    ):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        inside = rows < N
        valid = inside
        if HAS_COUNT:  # rows at or past the device count are ignored rows: 0, no reads
            valid = valid & (rows < tl.load(n_valid_ptr))
        y = tl.load(y_ptr + rows, mask=valid, other=0).to(tl.int64)
        x_row = x_ptr + rows.to(tl.int64)[:, None] * stride_x
        w_row = w_ptr + y[:, None] * stride_w
        acc = tl.zeros((BR, BH), tl.float32)
        for h0 in range(0, H, BH):
            hh = h0 + tl.arange(0, BH)
            mk = valid[:, None] & (hh < H)[None, :]
            x = tl.load(x_row + hh[None, :], mask=mk, other=0.0).to(tl.float32)
            w = tl.load(w_row + hh[None, :], mask=mk, other=0.0).to(tl.float32)
            acc += x * w
        z2 = tl.sum(acc, axis=1) * scale2
        if HAS_BIAS:
            z2 += tl.load(b2_ptr + y, mask=valid, other=0.0)
        tl.store(zy2_ptr + rows, tl.where(valid, z2, 0.0), mask=inside)


def target_logits(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    b2: torch.Tensor | None,
    scale2: float,
    n_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """zy₂ (N,) fp32 for rows x (N, H) (unit stride along H), targets y (N,) in [0, V) for the
    rows below the device count `n_valid` (int32 (1,); None: all rows), b2 the bias already
    scaled by log₂e / τ (fp32) or None. Rows at or past `n_valid` get 0."""
    N, H = x.shape
    zy2 = torch.empty(N, device=x.device, dtype=torch.float32)
    if N == 0:
        return zy2
    BR = 16
    BH = min(256, triton.next_power_of_2(H))
    _target_logit_kernel[(triton.cdiv(N, BR),)](
        x, x.stride(0), w, w.stride(0), y, b2 if b2 is not None else zy2, zy2,
        n_valid if n_valid is not None else zy2, N, H, scale2,
        HAS_BIAS=b2 is not None, HAS_COUNT=n_valid is not None, BR=BR, BH=BH, num_warps=4,
    )
    return zy2
