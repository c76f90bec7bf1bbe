"""Which rows of a call the chunk loop processes, and in what order: the row layout.

Rows whose target is `ignore_index` must cost no GEMM work, yet on CUDA their number must not
be read back to the host before the first kernel is issued (a sync per call: the GPU idles
while the host waits, then issues the first kernel). Two layouts; grpo_lce._dispatch picks one
(`Path.rows_on_device`):

  host-counted    `compact_rows`: the valid rows gathered, their number read on the host, every
                  GEMM sized by it. The target range check rides on the same read.
  device-counted  all N rows in a fixed order, valid ones first (a stable partition, no host
                  read; one launch on CUDA, kernels/partition), the hidden states of the others
                  zero, `n_valid` an int32 (1,) tensor on the device. The fused kernels
                  (kernels/gemm_softmax, kernels/gemm_rows) read it and skip the row blocks past
                  it: no host sync, and ignored rows still cost no GEMM work (only an (N, H)
                  gather and the per-row elementwise passes). It exists only on the fused path,
                  so its row kernels are Triton's (kernels/row_gather).

A trainable head in the device-counted layout also copies n_valid to the host
(`HostCount`, below). A target out of range in the device-counted layout on CUDA is flagged
on the device: its row is computed against target 0, its outputs become NaN, and a later call
raises (grpo_lce._checks.raise_deferred). Results go back to the caller's rows at the end of
this module (`values_to_caller`, `grad_to_caller`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_lce._checks import check_target_range
from grpo_lce._dispatch import Path
from grpo_lce.kernels.partition import partition_rows
from grpo_lce.kernels.row_gather import gather_rows, scatter_rows
from grpo_lce.kernels.scale_cast import scale_cast
from grpo_lce.kernels.split_float import join as join_split

# The device-counted row count on its way to the host, for a trainable head's cuBLAS GEMMs.
#
# In the device-counted layout (grpo_lce._rows) the number of valid rows lives on the device. A
# frozen head never needs it on the host. A trainable head's dW GEMM is faster in cuBLAS than in
# the Triton kernel that reads the count on the device (kernels/gemm_rows), and cuBLAS needs the
# count on the host. So the count is copied to pinned host memory right behind the partition
# kernel, without waiting, and the chunk loop reads it only after it has queued chunk 0's GEMM 1:
# the host then waits for the partition kernel alone while the GPU has a GEMM to run, where a
# read before the first GEMM would leave the GPU idle while the host waits.

class HostCount:
    """The count n_valid (int32 (1,)) copied to the host as soon as it is queued; `get` waits
    for that copy only (an event), not for the kernels queued after it. On CPU the count is
    already there."""

    def __init__(self, n_valid: torch.Tensor):
        self._event = None
        if n_valid.is_cuda:
            self._host = torch.empty(1, dtype=n_valid.dtype, pin_memory=True)
            self._host.copy_(n_valid, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = n_valid
        self._value: int | None = None

    def get(self) -> int:
        if self._value is None:
            if self._event is not None:
                self._event.synchronize()
            self._value = int(self._host[0])
        return self._value


@dataclass
class RowPlan:
    n: int  # rows the chunk loop processes
    idx: torch.Tensor | None  # host-counted: the valid rows (None: all); device: the order
    n_valid: torch.Tensor | None  # device-counted: int32 (1,) on the device; else None
    bad: torch.Tensor | None = None  # device-counted on CUDA: (n,) bool, target out of range
    valid_rows: torch.Tensor | None = None  # device-counted: (n,) bool, position < n_valid
    n_bad: torch.Tensor | None = None  # device-counted on CUDA: 0-d int32, targets out of range
    bad_message: str = ""
    count: HostCount | None = None  # device-counted, trainable head: n_valid for the host

    @property
    def valid(self) -> torch.Tensor | None:
        """Device-counted: (n,) bool, position < n_valid."""
        if self.valid_rows is None and self.n_valid is not None:
            self.valid_rows = valid_mask(self.n, self.n_valid)
        return self.valid_rows

    def saved(self) -> tuple:
        """The tensors to keep for backward, through ctx.save_for_backward (so they are freed
        with the node's other saved tensors, not kept until the graph dies)."""
        return self.idx, self.n_valid, self.valid

    @classmethod
    def from_saved(cls, n: int, idx: torch.Tensor | None, n_valid: torch.Tensor | None,
                   valid_rows: torch.Tensor | None, *, count: HostCount | None = None
                   ) -> RowPlan:
        return cls(n=n, idx=idx, n_valid=n_valid, valid_rows=valid_rows, count=count)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """The processed rows of t (N, ...) (hidden states, upstream gradients), contiguous in
        the last dim; in the device-counted layout the rows past n_valid are zero."""
        if self.n_valid is not None and t.dim() == 2:
            return gather_rows(t, self.idx, self.n_valid)  # one pass (kernels/row_gather)
        r = t if self.idx is None else t.index_select(0, self.idx)
        if r.dim() >= 2 and r.stride(-1) != 1:
            r = r.contiguous()
        valid = self.valid
        if valid is not None:
            shape = (-1,) + (1,) * (r.dim() - 1)
            # a where, not a product: an ignored row's NaN hidden state must not leak
            r = torch.where(valid.view(shape), r, 0.0 if r.is_floating_point() else 0)
        return r

    def own_rows(self, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(rows(t), whether they are a copy sharing no memory with t): a copy belongs to the
        call, which may overwrite it (the frozen head's basis goes over the rows, _head)."""
        r = self.rows(t)
        return r, r.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def valid_mask(n: int, n_valid: torch.Tensor) -> torch.Tensor:
    """(n,) bool: position < n_valid, the valid rows of the device-counted layout."""
    return torch.arange(n, device=n_valid.device) < n_valid


def plan_rows(
    y: torch.Tensor, vocab: int, ignore_index: int | None, name: str, path: Path
) -> tuple[RowPlan, torch.Tensor]:
    """(plan, targets of the processed rows as int64) for targets y (N,), in the layout `path`
    chose; with `path.count_to_host` the count's copy to the host starts here (`plan.count`).
    `name` is the argument the targets came in, for error messages."""
    N = y.numel()
    if not path.rows_on_device or N == 0:
        idx, n = compact_rows(y, vocab, ignore_index, name)
        y_rows = y if idx is None else y.index_select(0, idx)
        return RowPlan(n=n, idx=idx, n_valid=None), y_rows.long()

    if y.is_cuda:
        # one launch (kernels/partition): the first GEMM is not kept waiting on ~15 small ops
        order, y_rows, bad, valid, counts = partition_rows(y.contiguous(), vocab, ignore_index)
        message = f"{name} contained a value outside [0, {vocab})" + (
            f" other than ignore_index={ignore_index}" if ignore_index is not None else "")
        n_valid = counts[:1]
        return RowPlan(n=N, idx=order, n_valid=n_valid, bad=bad, valid_rows=valid,
                       n_bad=counts[1], bad_message=message,
                       count=HostCount(n_valid) if path.count_to_host else None), y_rows

    # the same layout in torch ops; no sync to avoid here: a bad target raises now
    keep = torch.ones_like(y, dtype=torch.bool) if ignore_index is None else y != ignore_index
    if bool((((y < 0) | (y >= vocab)) & keep).any()):
        check_target_range(y, vocab, ignore_index, name)
    # stable partition: valid rows first, in their order (argsort of a 0/1 key)
    order = torch.argsort((~keep).to(torch.uint8), stable=True)
    n_valid = keep.sum(dtype=torch.int32).reshape(1)
    y_rows = torch.where(valid_mask(N, n_valid), y.index_select(0, order), 0)
    return RowPlan(n=N, idx=order, n_valid=n_valid,
                   count=HostCount(n_valid) if path.count_to_host else None), y_rows.long()


def compact_rows(
    y: torch.Tensor, vocab: int, ignore_index: int | None, name: str
) -> tuple[torch.Tensor | None, int]:
    """Indices of the rows whose target is not `ignore_index`, and their number (host-counted).

    Returns (None, N) when every row is kept. The one host read of the call happens here: the
    number of valid rows sizes every GEMM that follows, and the target range check rides on the
    same read (so a bad target is an error, never an out-of-bounds gather in a kernel).
    """
    n = y.numel()
    if n == 0:
        return None, 0
    out_of_range = (y < 0) | (y >= vocab)
    if ignore_index is None:
        if bool(out_of_range.any()):
            check_target_range(y, vocab, ignore_index, name)
        return None, n
    keep = y != ignore_index
    n_keep, n_bad = torch.stack([keep.sum(), (out_of_range & keep).sum()]).tolist()
    if n_bad:
        check_target_range(y, vocab, ignore_index, name)
    if n_keep == n:
        return None, n
    # nonzero_static needs no second host read: the size is already known.
    idx = torch.nonzero_static(keep, size=n_keep).squeeze(1)
    return idx, n_keep


# ---- results back in the caller's rows (the inverse of the layout)
# Results of the processed rows back in the caller's rows (the inverse of grpo_lce._rows).
#
# Per-row values (log-probs, entropies), vals (n,) of the processed rows:
#     out[r] = vals[i] at the caller's row r held by processed row i, 0 at the ignored rows,
#              NaN where the target was out of range (device-counted layout on CUDA)
# Per-row indices (the argmax), idx (n,) int64: the same, with −1 at the ignored rows.
# Gradients of the hidden states, from (n, H) fp32 gradient bases u, v:
#     dh[r] = (a_r u[i] + b_r v[i]).to(dtype),  0 at the ignored rows
#     a_r = s_u · w_u[r] for per-caller-row weights w_u (N,) (the upstream gradient), s_u · w_u
#     for a 0-dim one, s_u for none; b alike (a `Term` each)
# In the device-counted layout this is one pass of kernels/row_gather (scaled, cast and put back
# in the caller's order at once); otherwise torch ops.

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
