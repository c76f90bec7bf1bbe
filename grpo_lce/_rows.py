"""Which rows of a call the chunk loop processes, and how its results go back to the caller's.

Rows whose target is `ignore_index` must cost no GEMM work, yet on CUDA their number must not
be read back to the host before the first kernel is issued (a sync per call: the GPU idles
while the host waits, then issues the first kernel). Two layouts:

  host-counted  `compact_rows`: the valid rows gathered, their number read on the host, every
                GEMM sized by it. The unfused loop (fp16 / fp32, pre-Hopper GPUs, the entropy
                basis, a trainable bias) uses it, and everything when GRPO_LCE_SYNC_CHECKS=1.
  device-counted  all N rows in a fixed order, valid ones first (a stable partition, no host
                read; one launch on CUDA, kernels/partition), the hidden states of the others
                zero, `n_valid` an int32 (1,) tensor on the device. The fused kernels
                (kernels/gemm_softmax, kernels/gemm_rows) read it and skip the row blocks past
                it: no host sync, and ignored rows still cost no GEMM work (only an (N, H)
                gather and the per-row elementwise passes).

A trainable head takes the device-counted layout too, but its dW GEMM is faster in cuBLAS
(the Triton one that reads the count on the device measured up to 1.3x slower,
bench/results/tune_gemm_rows_H200.json), and cuBLAS needs the count on the host. `HostCount`
copies it there right behind the partition kernel, without waiting; the chunk loop reads it
only after it has queued chunk 0's GEMM 1, so the host waits for the partition kernel alone
while the GPU has a GEMM to run (the host-counted layout's read let the GPU idle ~0.5 ms a call
at qwen-0.5b shapes, bench/results/profile_head_H200_qwen0.5b_iii.txt).

Targets out of range cannot raise at once without a sync in the device-counted layout: such a
row is computed against target 0 and its outputs set to NaN (never a silently wrong number, never
an out-of-bounds read), and the error is raised, naming the argument, by the first call that
finds the flag copied back (`raise_deferred`; GRPO_LCE_SYNC_CHECKS=1 raises in the call itself).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from grpo_lce._checks import check_target_range
from grpo_lce._chunks import compact_rows
from grpo_lce._head_fused import use_fused
from grpo_lce.kernels.partition import partition_rows
from grpo_lce.kernels.row_gather import gather_rows, scatter_rows
from grpo_lce.kernels.row_softmax import select_backend
from grpo_lce.kernels.scale_cast import scale_cast
from grpo_lce.kernels.split_float import join as join_split


def sync_checks() -> bool:
    """GRPO_LCE_SYNC_CHECKS=1: host-counted rows everywhere, target errors raised in the call."""
    return os.environ.get("GRPO_LCE_SYNC_CHECKS", "0") == "1"


def count_on_device(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *,
                    want_ebasis: bool = False) -> bool:
    """Whether a call over hidden rows h (N, H) and head w (bias b) takes the device-counted
    layout: its forward runs on the fused path and its bias will get no gradient (see the
    module docstring)."""
    trainable_bias = torch.is_grad_enabled() and b is not None and b.requires_grad
    if trainable_bias or want_ebasis or sync_checks():
        return False
    return use_fused(h, w, want_ebasis=False, want_grad_bias=False, beta=None, gathered=True)


def head_trainable(w: torch.Tensor) -> bool:
    """Whether the call will build dW, whose cuBLAS GEMM wants the row count on the host."""
    return torch.is_grad_enabled() and w.requires_grad


class HostCount:
    """The device count of valid rows on its way to the host: a copy to pinned memory queued
    right behind the partition kernel, read by `get` when needed. `get` waits for that copy
    only (an event), not for the kernels queued after it. On CPU the count is already there."""

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


def valid_mask(n: int, n_valid: torch.Tensor) -> torch.Tensor:
    """(n,) bool: position < n_valid, the valid rows of the device-counted layout."""
    return torch.arange(n, device=n_valid.device) < n_valid


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

    def report_bad(self) -> None:
        """Queue the deferred target-range error (see `raise_deferred`). Called once the call's
        kernels are issued: the copy back then waits behind them instead of delaying them."""
        if self.n_bad is not None:
            _defer_error(self.n_bad, self.bad_message)

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
                   valid_rows: torch.Tensor | None) -> RowPlan:
        return cls(n=n, idx=idx, n_valid=n_valid, valid_rows=valid_rows)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """The processed rows of t (N, ...) (hidden states, upstream gradients), contiguous in
        the last dim; in the device-counted layout the rows past n_valid are zero."""
        if self.n_valid is not None and t.dim() == 2 and select_backend(t) == "triton":
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
        call, which may overwrite it (the frozen head's basis goes over the rows, _head_fused)."""
        r = self.rows(t)
        return r, r.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()

    def to_all_rows(self, vals: torch.Tensor, n_all: int) -> torch.Tensor:
        """(n_all, ...) results of the caller's rows from the processed rows' vals, 0 at ignored
        rows (the device-counted kernels already wrote 0 past n_valid)."""
        if self.idx is None:
            return vals
        if self.n_valid is not None:  # a permutation: every row is written once
            return torch.empty_like(vals).index_copy_(0, self.idx, vals)
        return vals.new_zeros((n_all, *vals.shape[1:])).index_copy_(0, self.idx, vals)

    def grad_to_all_rows(
        self, n_all: int, dtype: torch.dtype, u: torch.Tensor, w_u: torch.Tensor | None,
        s_u: float = 1.0, v: torch.Tensor | None = None, w_v: torch.Tensor | None = None,
        s_v: float = 1.0, u_lo: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(n_all, H) in `dtype`: a_r u[i] + b_r v[i] at the caller's row r held by processed
        row i, 0 at the ignored rows; u, v (n, H) fp32 gradient bases (u split in 3 bytes, bf16
        u and uint8 `u_lo`, from the fused path: kernels/split_float), a_r = s_u · w_u[r] for
        per-caller-row weights w_u (n_all,), s_u · w_u for a 0-dim one, s_u for None; b alike.
        The device-counted layout on the Triton backend does it in one pass (kernels/
        row_gather); otherwise torch ops."""
        if self.n_valid is not None and select_backend(u) == "triton":
            def prep(w):
                return None if w is None else w.contiguous()
            return scatter_rows(u, prep(w_u), self.idx, self.n_valid, dtype, s_u=s_u,
                                v=v, w_v=prep(w_v), s_v=s_v, u_lo=u_lo)
        if u_lo is not None:
            u = join_split(u, u_lo)

        def weight(w, s):  # per processed row (n, 1), or a scalar
            if w is None:
                return s
            return w.float() * s if w.dim() == 0 else self.rows(w).float()[:, None] * s
        if self.idx is None and v is None and w_u is not None and w_u.dim() == 0:
            return scale_cast(u, w_u.float() * s_u, dtype)  # every row valid: one pass
        acc = u * weight(w_u, s_u)
        if v is not None:
            acc = acc + v * weight(w_v, s_v)
        return self.to_all_rows(acc.to(dtype), n_all)

    def mark_bad(self, vals: torch.Tensor) -> torch.Tensor:
        """NaN at the rows whose target was out of range (device-counted layout)."""
        if self.bad is None:
            return vals
        return vals.masked_fill(self.bad.view((-1,) + (1,) * (vals.dim() - 1)), float("nan"))


def plan_rows(
    y: torch.Tensor, vocab: int, ignore_index: int | None, name: str, *, on_device: bool,
    host_count: bool = False,
) -> tuple[RowPlan, torch.Tensor]:
    """(plan, targets of the processed rows as int64) for targets y (N,). `host_count`: in the
    device-counted layout, also start the count's copy to the host (`plan.count`)."""
    N = y.numel()
    if not on_device or N == 0:
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
                       count=HostCount(n_valid) if host_count else None), y_rows

    # the same layout in torch ops; no sync to avoid here: a bad target raises now
    keep = torch.ones_like(y, dtype=torch.bool) if ignore_index is None else y != ignore_index
    if bool((((y < 0) | (y >= vocab)) & keep).any()):
        check_target_range(y, vocab, ignore_index, name)
    # stable partition: valid rows first, in their order (argsort of a 0/1 key)
    order = torch.argsort((~keep).to(torch.uint8), stable=True)
    n_valid = keep.sum(dtype=torch.int32).reshape(1)
    y_rows = torch.where(valid_mask(N, n_valid), y.index_select(0, order), 0)
    return RowPlan(n=N, idx=order, n_valid=n_valid,
                   count=HostCount(n_valid) if host_count else None), y_rows.long()


# --- deferred target-range errors (device-counted layout on CUDA) ---

_pending: list[tuple[torch.Tensor, torch.cuda.Event, str]] = []


def _defer_error(flag: torch.Tensor, message: str) -> None:
    """Copy the 0-d `flag` (nonzero: error) to pinned host memory without waiting;
    `raise_deferred` reads it once the copy has landed."""
    host = torch.empty((), dtype=flag.dtype, pin_memory=True)
    host.copy_(flag, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _pending.append((host, event, message))


def raise_deferred() -> None:
    """Raise the error of an earlier call whose targets were out of range, if its flag has
    reached the host (an event query: never waits)."""
    still = []
    for host, event, message in _pending:
        if not event.query():
            still.append((host, event, message))
        elif bool(host):
            _pending.clear()
            raise ValueError(
                f"{message} in an earlier call (its rows gave NaN). On CUDA the check runs "
                "without a host sync and is reported late; set GRPO_LCE_SYNC_CHECKS=1 to "
                "raise in the call itself."
            )
    _pending[:] = still
