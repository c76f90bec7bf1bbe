"""Results of the processed rows back in the caller's rows (the inverse of grpo_lce._rows).

Per-row values (log-probs, entropies), vals (n,) of the processed rows:
    out[r] = vals[i] at the caller's row r held by processed row i, 0 at the ignored rows,
             NaN where the target was out of range (device-counted layout on CUDA)
Per-row indices (the argmax), idx (n,) int64: the same, with −1 at the ignored rows.
Gradients of the hidden states, from (n, H) fp32 gradient bases u, v:
    dh[r] = (a_r u[i] + b_r v[i]).to(dtype),  0 at the ignored rows
    a_r = s_u · w_u[r] for per-caller-row weights w_u (N,) (the upstream gradient), s_u · w_u
    for a 0-dim one, s_u for none; b alike (a `Term` each)
In the device-counted layout this is one pass of kernels/row_gather (scaled, cast and put back
in the caller's order at once); otherwise torch ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_lce._rows import RowPlan
from grpo_lce.kernels.row_gather import scatter_rows
from grpo_lce.kernels.scale_cast import scale_cast
from grpo_lce.kernels.split_float import join as join_split


@dataclass(frozen=True)
class Term:
    """a_r · u[i] of a gradient (module docstring)."""

    u: torch.Tensor  # (n, H) fp32, or its bf16 half when `lo` is given
    weight: torch.Tensor | None = None  # (N,) per caller row, 0-dim, or None (1)
    scale: float = 1.0
    lo: torch.Tensor | None = None  # (n, H) uint8: u kept in 3 bytes (kernels/split_float)


def values_to_caller(plan: RowPlan, vals: torch.Tensor, n_all: int) -> torch.Tensor:
    """(n_all, ...) per-row results in the caller's rows from the processed rows' vals
    (module docstring)."""
    if plan.bad is not None:
        vals = vals.masked_fill(plan.bad.view((-1,) + (1,) * (vals.dim() - 1)), float("nan"))
    return _to_caller(plan, vals, n_all)


def indices_to_caller(plan: RowPlan, idx: torch.Tensor, n_all: int) -> torch.Tensor:
    """(n_all,) int64 per-row indices (the argmax) in the caller's rows, −1 at the ignored ones
    (the device-counted kernels already wrote −1 past n_valid)."""
    return _to_caller(plan, idx, n_all, fill=-1)


def grad_to_caller(plan: RowPlan, u: Term, v: Term | None = None, *, n_all: int,
                   dtype: torch.dtype, backend: str) -> torch.Tensor:
    """dh (n_all, H) in `dtype` (module docstring); `backend` runs scale_cast."""
    if plan.n_valid is not None:  # device-counted (fused path, Triton): one pass
        def prep(w):
            return None if w is None else w.contiguous()
        return scatter_rows(u.u, prep(u.weight), plan.idx, plan.n_valid, dtype, s_u=u.scale,
                            v=None if v is None else v.u, w_v=None if v is None else prep(v.weight),
                            s_v=1.0 if v is None else v.scale, u_lo=u.lo)
    uu = u.u if u.lo is None else join_split(u.u, u.lo)

    def weight(t: Term):  # per processed row (n, 1), or a scalar
        if t.weight is None:
            return t.scale
        if t.weight.dim() == 0:
            return t.weight.float() * t.scale
        return plan.rows(t.weight).float()[:, None] * t.scale
    if plan.idx is None and v is None and u.weight is not None and u.weight.dim() == 0:
        return scale_cast(uu, u.weight.float() * u.scale, dtype, backend=backend)  # one pass
    acc = uu * weight(u)
    if v is not None:
        acc = acc + v.u * weight(v)
    return _to_caller(plan, acc.to(dtype), n_all)


def _to_caller(plan: RowPlan, vals: torch.Tensor, n_all: int, fill: float = 0) -> torch.Tensor:
    """vals of the processed rows put at their caller rows, `fill` at the ignored ones (the
    device-counted kernels already wrote it past n_valid)."""
    if plan.idx is None:
        return vals
    if plan.n_valid is not None:  # a permutation: every row is written once
        return torch.empty_like(vals).index_copy_(0, plan.idx, vals)
    return vals.new_full((n_all, *vals.shape[1:]), fill).index_copy_(0, plan.idx, vals)
