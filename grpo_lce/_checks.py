"""Argument checks shared by the public functions.

Every error names the argument and the values it had, so a shape mistake deep inside a trainer
reads as what it is. `assert` is kept for internal invariants only.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the head ops compute in


def check_head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """hidden (..., H), weight (V, H), bias (V,): float, same dtype and device."""
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{name} must be float32, bfloat16 or float16, got {t.dtype}"
                + (" (a quantized lm_head is not supported: dequantize it first)"
                   if name == "weight" else "")
            )
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (V, H), got shape {tuple(weight.shape)}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dimension (..., H), got a scalar")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden has H={hidden.shape[-1]} but weight has H={weight.shape[1]} "
            f"(hidden shape {tuple(hidden.shape)}, weight shape {tuple(weight.shape)})"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"hidden is {hidden.dtype} but weight is {weight.dtype}: pass both in one dtype "
            "(the logits are accumulated in fp32 whatever it is)"
        )
    if hidden.device != weight.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(
                f"bias must have shape (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}"
            )
        if bias.device != weight.device:
            raise ValueError(f"bias is on {bias.device} but weight is on {weight.device}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias is {bias.dtype} but weight is {weight.dtype}")


def check_targets(
    targets: torch.Tensor, hidden: torch.Tensor, vocab: int, ignore_index: int | None, name: str
) -> None:
    """targets (...) integer, matching hidden's leading shape, in [0, V) or ignore_index.

    The range check itself (`check_target_range`) reads a reduction back to the host: the
    host-counted row layout runs it on the host read it already makes; the device-counted one
    (grpo_lce._rows) flags bad targets on the device instead (NaN rows, a deferred error).
    """
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.is_complex():
        raise TypeError(f"{name} must be an integer tensor, got {targets.dtype}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"{name} has shape {tuple(targets.shape)} but hidden has leading shape "
            f"{tuple(hidden.shape[:-1])} (hidden shape {tuple(hidden.shape)})"
        )
    if targets.device != hidden.device:
        raise ValueError(f"{name} is on {targets.device} but hidden is on {hidden.device}")


def check_target_range(
    y: torch.Tensor, vocab: int, ignore_index: int | None, name: str
) -> None:
    """Raise if any target is outside [0, V) and is not ignore_index. Synchronises: see above."""
    if y.numel() == 0:
        return
    bad = (y < 0) | (y >= vocab)
    if ignore_index is not None:
        bad &= y != ignore_index
    if bool(bad.any()):
        first = y[bad][0].item()
        raise ValueError(
            f"{name} contains {first}, outside [0, {vocab}) "
            + (f"and not ignore_index={ignore_index}" if ignore_index is not None else "")
        )


def check_temperature(temperature: float) -> float:
    if isinstance(temperature, torch.Tensor):
        raise TypeError("temperature must be a Python float, not a tensor")
    t = float(temperature)
    if not (t > 0.0) or math.isinf(t):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return t


def check_chunk_size(chunk_size: int | None) -> None:
    if chunk_size is None:
        return
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int or None, got {type(chunk_size).__name__}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")


# ---- deferred target-range errors
# Target-range errors of the device-counted layout on CUDA, raised by a later call.
#
# Checking that every target is in [0, V) needs a reduction read on the host: a sync, which the
# device-counted layout exists to avoid. There a bad row is computed against target 0 and its
# outputs are set to NaN (never a silently wrong number, never an out-of-bounds read;
# grpo_lce._rows), and its flag is copied to pinned host memory behind the call's kernels. The
# first public call that finds a copied flag set raises, naming the argument
# (GRPO_LCE_SYNC_CHECKS=1 raises in the call itself instead: grpo_lce._dispatch).
#
# The queue is process-wide: an error belongs to whichever call comes next, on any thread.

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
