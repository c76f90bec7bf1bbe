"""The decode step's bookkeeping after sampling, in one launch (`record_step`).

For the working rows b of a decode step, with y_b the drawn token and lp_b its log-prob:

    y_b  <- pad where done_b (a finished row emits padding),   lp_b <- 0 there
    out[row_b, step] = y_b,  logp[row_b, step] = lp_b     (row_b = rows_b for a bucket, else b)
    slot_b += 1 where not done_b (before the update below)
    done_b  = done_b or y_b ∈ eos
    cur_b   = y_b
    step   += 1

which is what the decode loop's torch ops do (`record_step_torch`: two `where`s, two scatters,
the slot add, the EOS compare and reduction, the copy, the step add: about ten launches a
step, each a few rows' work). Integer and copy operations only: the kernel's results are bit
for bit the torch ops'.

One program: every row's values are read and written by the same thread, and `step` is read
and written by one warp (a load before a store in each lane's program order; another warp
could read it after the store), so the launch uses one warp for any batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interp import interpreting
from .pdl import grid_wait, launch_args


@triton.jit
def _record_kernel(y_ptr, lp_ptr, done_ptr, eos_ptr, out_ptr, logp_ptr, step_ptr, slot_ptr,
                   cur_ptr, rows_ptr, B, E, pad, stride_out, stride_logp,
                   HAS_ROWS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr,
                   PDL: tl.constexpr):
    grid_wait(PDL)  # kernels.pdl: launched early, this kernel reads nothing before it
    b = tl.arange(0, BLOCK_B)
    ok = b < B
    done = tl.load(done_ptr + b, mask=ok, other=0) != 0
    y = tl.where(done, pad, tl.load(y_ptr + b, mask=ok, other=0))
    lp = tl.where(done, 0.0, tl.load(lp_ptr + b, mask=ok, other=0.0))
    col = tl.load(step_ptr)
    if HAS_ROWS:
        row = tl.load(rows_ptr + b, mask=ok, other=0)
    else:
        row = b.to(tl.int64)
    tl.store(out_ptr + row * stride_out + col, y, mask=ok)
    tl.store(logp_ptr + row * stride_logp + col, lp, mask=ok)
    slot = tl.load(slot_ptr + b, mask=ok, other=0)
    tl.store(slot_ptr + b, slot + tl.where(done, 0, 1), mask=ok)
    e = tl.arange(0, BLOCK_E)
    eos = tl.load(eos_ptr + e, mask=e < E, other=0)
    hit = (y[:, None] == eos[None, :]) & (e < E)[None, :]
    ended = done | (tl.max(hit.to(tl.int32), axis=1) > 0)
    tl.store(done_ptr + b, ended, mask=ok)
    tl.store(cur_ptr + b, y, mask=ok)
    tl.store(step_ptr, col + 1)


def record_step_torch(y, lp, done, eos, pad, out, logp, step, slot, cur, rows=None):
    """The same in torch ops (module docstring)."""
    y = torch.where(done, pad, y)
    lp = torch.where(done, torch.zeros_like(lp), lp)
    if rows is None:
        col = step.view(1, 1).expand(y.shape[0], 1)
        out.scatter_(1, col, y[:, None])
        logp.scatter_(1, col, lp[:, None])
    else:  # original row rows_b, flat index into (B, width)
        flat = rows * out.shape[1] + step
        out.view(-1).scatter_(0, flat, y)
        logp.view(-1).scatter_(0, flat, lp)
    slot.add_((~done).long())
    done.logical_or_((y[:, None] == eos[None]).any(1))  # (B, E) compare, E EOS ids
    cur.copy_(y)
    step.add_(1)


def record_step(y: torch.Tensor, lp: torch.Tensor, done: torch.Tensor, eos: torch.Tensor,
                pad: int, out: torch.Tensor, logp: torch.Tensor, step: torch.Tensor,
                slot: torch.Tensor, cur: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Records a decode step's tokens y (B,) int64 and log-probs lp (B,) fp32 and advances the
    row state in place (module docstring): done (B,) bool, slot and cur (B,) int64, step (1,)
    int64, out (R, W) int64 and logp (R, W) fp32 with unit column stride, rows (B,) int64 or
    None (then R ≥ B), eos (E,) int64. One Triton launch on CUDA and under the interpreter, the
    torch ops elsewhere."""
    if not (y.device.type == "cuda" or interpreting()):
        return record_step_torch(y, lp, done, eos, pad, out, logp, step, slot, cur, rows)
    B, E = y.shape[0], eos.shape[0]
    for name, t, dtype in (("y", y, torch.long), ("lp", lp, torch.float32),
                           ("done", done, torch.bool), ("slot", slot, torch.long),
                           ("cur", cur, torch.long)):
        if t.shape != (B,) or t.dtype != dtype or t.stride(0) != 1:
            raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype} (stride {t.stride()}), "
                             f"expected ({B},) {dtype}, contiguous")
    if out.stride(1) != 1 or logp.stride(1) != 1 or out.shape != logp.shape:
        raise ValueError(f"out {tuple(out.shape)} and logp {tuple(logp.shape)} need one shape "
                         f"and unit column strides")
    if step.numel() != 1 or E < 1 or (rows is not None and rows.shape != (B,)):
        raise ValueError(f"step has {step.numel()} elements (1 expected), eos {E} ids (at "
                         f"least 1), rows {None if rows is None else tuple(rows.shape)}")
    _record_kernel[(1,)](
        y, lp, done, eos, out, logp, step, slot, cur, rows if rows is not None else slot,
        B, E, int(pad), out.stride(0), logp.stride(0),
        HAS_ROWS=rows is not None, BLOCK_B=triton.next_power_of_2(B),
        BLOCK_E=triton.next_power_of_2(E), num_warps=1,
        **launch_args(_record_kernel, y.device))
    return None
