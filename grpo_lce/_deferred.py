"""Target-range errors of the device-counted layout on CUDA, raised by a later call.

Checking that every target is in [0, V) needs a reduction read on the host: a sync, which the
device-counted layout exists to avoid. There a bad row is computed against target 0 and its
outputs are set to NaN (never a silently wrong number, never an out-of-bounds read; grpo_lce.
_row_results), and its flag is copied to pinned host memory behind the call's kernels. The
first public call that finds a copied flag set raises, naming the argument
(GRPO_LCE_SYNC_CHECKS=1 raises in the call itself instead: grpo_lce._dispatch).

The queue is process-wide: an error belongs to whichever call comes next, on any thread.
"""

from __future__ import annotations

import torch

_pending: list[tuple[torch.Tensor, torch.cuda.Event, str]] = []


def defer(flag: torch.Tensor | None, message: str) -> None:
    """Copy the 0-d `flag` (nonzero: error) to the host without waiting; `raise_deferred` reads
    it once the copy has landed. Called once the call's kernels are issued, so that the copy
    waits behind them instead of delaying them. None: nothing to check (host-counted layout)."""
    if flag is None:
        return
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
