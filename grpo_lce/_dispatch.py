"""Which path a call takes: decided here, once per call, and passed down as a `Path`.

A call of `linear_logprobs`, `linear_cross_entropy` or `chunked_linear` makes two choices.

GEMM 1 and the row statistics (grpo_lce._head):
    fused     GEMM 1 is the Triton kernel of kernels/gemm_softmax, whose epilogue turns each fp32
              logits tile, still in registers, into softmax partials and the bf16 operand G' of
              GEMM 2 (grpo_lce._head). Needs bf16 operands, a Hopper-or-newer GPU (or
              Triton's interpreter), a triton with `triton.tools.tensor_descriptor`, and TMA's
              16-byte alignment of W's rows and of h's rows. Its G' gives G = α (p − e_y) only,
              so a pass that needs the entropy operand, β's term or a bias gradient runs
              unfused (`Path.fuses`).
    unfused   GEMM 1 by cuBLAS into one reused fp32 chunk (torch.mm with fp32 output), then the
              row kernel of kernels/row_softmax: in Triton (`backend == "triton"`) or in torch
              ops (`"torch"`: CPU, or no triton). The same backend runs the small row kernels
              (kernels/row_gather, kernels/scale_cast).

The row layout (grpo_lce._rows):
    device-counted  the ignored rows moved after the valid ones, their number left on the
              device: no host sync. Only on the fused path, with no trainable bias, no entropy
              basis and sync checks off; with a trainable weight the count is also copied to
              the host (grpo_lce._rows.HostCount) for the cuBLAS dW GEMM.
    host-counted    the valid rows gathered, their number read on the host: one sync a call.

`decide` reads everything the choice depends on, once: the operands' dtype, device, compute
capability, strides and alignment; whether weight and bias get a gradient (grad mode and
requires_grad, as the caller has them); `entropy_requires_grad`; whether triton and its tensor
descriptors import (HAS_TRITON, HAS_TMA: kernels/_triton); and four environment variables:

    GRPO_LCE_BACKEND=auto|triton|torch  who runs the row kernels (auto: Triton on CUDA)
    GRPO_LCE_FUSED=0                    never the fused GEMM 1 (A/B comparisons, a suspected bug)
    GRPO_LCE_SYNC_CHECKS=1              host-counted rows everywhere: a target out of range
                                        raises in the call itself, not in a later one
    TRITON_INTERPRET=1                  Triton's own switch (kernels run in its interpreter);
                                        it lets the fused path run on CPU, as the tests do

Seams for tests and debugging, instead of patching module attributes: `override(backend=,
fused=, sync_checks=)` takes precedence over the environment inside a `with` block, and
`recording()` collects the Paths decided inside it and the events the chunk loops note on them:

    "gemm1"       rows of a fused GEMM 1 launch (one per chunk)
    "flagged"     a chunk's count of flagged rows (int32 (1,) on the device; _head)
    "count read"  a host read of the device row count (grpo_lce._rows.HostCount), with its value
    "basis"       (rows are the call's copy, basis dtype, its low half's dtype or None,
                  whether the basis is stored over the rows), once per pass that builds it
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_lce.kernels._triton import HAS_TMA, HAS_TRITON, interpreting

BACKENDS = ("auto", "triton", "torch")


@dataclass
class Record:
    """What `recording()` collected: the Paths decided and the (kind, value) events, in order."""

    paths: list[Path] = field(default_factory=list)
    events: list[tuple[str, Any]] = field(default_factory=list)

    def of(self, kind: str) -> list:
        """The values of the events of one kind, in order."""
        return [v for k, v in self.events if k == kind]


@dataclass(frozen=True)
class Path:
    """The choices of one call (module docstring); every layer below reads them from here."""

    backend: str  # "triton" | "torch": the row kernels (row_softmax, row_gather, scale_cast)
    fused: bool  # GEMM 1 is the fused kernel in every pass whose operands it computes
    rows_on_device: bool  # the device-counted row layout
    count_to_host: bool  # ... with the row count also copied to the host (a trainable head)
    record: Record | None = field(default=None, compare=False, repr=False)

    def fuses(self, spec: Any) -> bool:
        """Whether a pass runs the fused loop: this call's operands allow it (`fused`) and the
        pass (a grpo_lce._head.HeadPass) asks only for what the fused kernel computes. The one
        place this is decided; the row layout (`rows_on_device`) follows from `fused`."""
        return self.fused and spec.fusable

    def note(self, kind: str, value: Any = None) -> None:
        """An event for the active `recording()`, if the call was decided inside one."""
        if self.record is not None:
            self.record.events.append((kind, value))


_override: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "grpo_lce_override", default=None)
_recording: contextvars.ContextVar[Record | None] = contextvars.ContextVar(
    "grpo_lce_recording", default=None)


@contextlib.contextmanager
def override(*, backend: str | None = None, fused: bool | None = None,
             sync_checks: bool | None = None) -> Iterator[None]:
    """Inside the block, these choices replace the environment's (None: leave that one be).

    `backend` as GRPO_LCE_BACKEND; `fused=False` as GRPO_LCE_FUSED=0 (True: fused wherever
    supported); `sync_checks` as GRPO_LCE_SYNC_CHECKS=1. Nested blocks add to the outer one's."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    choices = dict(_override.get() or {})
    for name, value in (("backend", backend), ("fused", fused), ("sync_checks", sync_checks)):
        if value is not None:
            choices[name] = value
    token = _override.set(choices)
    try:
        yield
    finally:
        _override.reset(token)


@contextlib.contextmanager
def recording() -> Iterator[Record]:
    """Collect the Paths decided inside the block and the events noted on them (module
    docstring); a backward run later still notes on its forward's Path."""
    record = Record()
    token = _recording.set(record)
    try:
        yield record
    finally:
        _recording.reset(token)


def decide(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           entropy_basis: bool = False) -> Path:
    """The Path of one call over hidden (N, H) (the caller's rows, flattened), weight (V, H) and
    bias (V,) or None, decided where grad mode is the caller's (before the autograd Function).
    `entropy_basis`: entropy_requires_grad (its operand E needs the unfused loop)."""
    forced = _override.get() or {}
    backend = _backend(hidden.is_cuda, forced.get("backend"))
    if "sync_checks" in forced:
        sync_checks = bool(forced["sync_checks"])
    else:
        sync_checks = os.environ.get("GRPO_LCE_SYNC_CHECKS", "0") == "1"
    if "fused" in forced:
        allow_fused = bool(forced["fused"])
    else:
        allow_fused = os.environ.get("GRPO_LCE_FUSED", "1") != "0"
    fused_runs = allow_fused and backend == "triton" and _fused_kernel_runs(hidden, weight)
    grad = torch.is_grad_enabled()
    trainable_bias = grad and bias is not None and bias.requires_grad
    on_device = (fused_runs and hidden.shape[0] > 0
                 and not (trainable_bias or entropy_basis or sync_checks))
    path = Path(
        backend=backend,
        # the device-counted layout hands GEMM 1 a gathered copy of the rows, always aligned;
        # the host-counted one may hand over the caller's own rows
        fused=fused_runs and (on_device or _rows_aligned(hidden)),
        rows_on_device=on_device,
        count_to_host=on_device and grad and weight.requires_grad,
        record=_recording.get(),
    )
    if path.record is not None:
        path.record.paths.append(path)
    return path


def _backend(on_cuda: bool, forced: str | None) -> str:
    """'triton' on CUDA, 'torch' elsewhere, unless GRPO_LCE_BACKEND (or `override`) says which."""
    if forced is not None:
        choice, source = forced, f"override(backend={forced!r})"
    else:
        choice = os.environ.get("GRPO_LCE_BACKEND", "auto").lower()
        source = f"GRPO_LCE_BACKEND={choice}"
        if choice not in BACKENDS:
            raise ValueError(f"GRPO_LCE_BACKEND must be auto, triton or torch, got {choice!r}")
    if choice == "torch" or not HAS_TRITON:
        if choice == "triton":
            raise RuntimeError(f"{source} but triton is not installed")
        return "torch"
    if choice == "triton":
        return "triton"
    return "triton" if on_cuda else "torch"


def _fused_kernel_runs(h: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the fused GEMM can run on rows of h (N, H) laid out afresh and on w (V, H):
    Triton with tensor descriptors, a Hopper-or-newer GPU (or the interpreter), bf16, and the
    TMA's 16-byte alignment of a row of h and of w's base address and row stride."""
    # bf16 only: G' relies on bf16 having fp32's exponent range (fp16's 2^-24..2^16 would need
    # the shift within a few units of the row max, which no tile knows)
    if not HAS_TMA or h.dtype != torch.bfloat16 or w.dtype != h.dtype:
        return False
    if h.is_cuda:
        if torch.cuda.get_device_capability(h.device)[0] < 9:
            return False
    elif not interpreting():
        return False
    K = h.shape[-1]
    return ((K * h.element_size()) % 16 == 0 and w.stride(1) == 1
            and (w.stride(0) * w.element_size()) % 16 == 0 and w.data_ptr() % 16 == 0)


def _rows_aligned(h: torch.Tensor) -> bool:
    """Whether the caller's rows h (N, H), handed to GEMM 1 as they are (host-counted layout),
    meet the TMA's alignment: row stride and base address on 16 bytes. Rows not unit-stride
    along H are copied (contiguous) first, which always does. (A call that drops ignored rows
    gathers a copy too; the choice does not read the targets, so it follows the caller's rows.)"""
    if h.stride(-1) != 1:
        return True
    return (h.stride(0) * h.element_size()) % 16 == 0 and h.data_ptr() % 16 == 0
