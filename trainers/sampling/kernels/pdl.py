"""Programmatic dependent launch (PDL) for the decode step's kernels: the decision (made here),
the wait a kernel launched with it executes, and the early start the decode linear gives the
kernel after it.

A decode step is a chain of short kernels (for each layer: add_rmsnorm, the q/k/v projection,
RoPE + cache write, attention, o, add_rmsnorm, gate/up, down). A plain launch starts its first
program only once the kernel before it has completed and its writes are flushed. On Hopper and
later a kernel launched with PDL (Triton's `launch_pdl`: CUDA's programmatic stream
serialization, a programmatic edge when a CUDA graph captures it) starts as soon as every
program of the kernel before it has exited, and waits inside for the rest:

    grid_wait(PDL)   griddepcontrol.wait: blocks until the previous kernel has completed and
                     its memory writes are visible

so the launch, and whatever the kernel does before `grid_wait`, overlap the previous kernel's
completion. The decode linear issues its first step's weight loads there (the packed weight
does not depend on the previous kernel); the other kernels wait first.

A kernel may also let the next one start before its own programs exit
(griddepcontrol.launch_dependents, `let_next_launch`): the next kernel's programs are then placed
on whichever SMs have room at that moment and wait there. The decode linear does, after its K
loop, when all of its programs run at once (`linear4bit._early_next`: the register tile, a
grid of at most PROGRAMS_PER_SM programs a SM; the warp-specialized kernel's launches of up to
`linear4bit_ws.EARLY_NEXT_CTAS_PER_SM` CTAs a SM), so the next kernel's launch overlaps the
linear's epilogues (the split-K sums). add_rmsnorm and the decode attention do at their start
(`next_at_start`, SMALL_NEXT_AT_START): each is a few programs, and the decode linear after it
copies its first stages' weights before its wait, so those copies overlap the small kernel's
whole run instead of its exit (bench/README.md, the PDL runs: letting the next kernel start at
every kernel's beginning, the linear's included, measured slower).

The rules every kernel launched with PDL follows, which make it exactly as ordered as a plain
launch for every value it reads or writes:
- before `grid_wait` it reads only memory that no kernel of the decode step or of the loop
  around it writes, and writes nothing: a small kernel lets the next one launch before its own
  wait, so the kernels still running then are not only the one just before. The decode linear
  reads its packed weight and quantization state there, and launches use PDL only inside a
  decode step (`decode_step()`, which the decode loop holds around its steps), where every
  kernel is one of the step's or of the loop around it (prefill, sampling, state updates):
  none writes a weight;
- every program calls `grid_wait` on every path: a kernel then completes only after the one
  before it completed, so completion passes down the chain and a kernel that reads the output
  of one two launches back also sees it.
A kernel launched without PDL (torch's, or ours with PDL off) waits for its predecessor as
always.

`pdl_reason(device)` decides (None: PDL on): inside `decode_step()`, CUDA compute capability
9.0 or higher, Triton's launcher has the `launch_pdl` option, not Triton's interpreter, and
GRPO_LCE_PDL is not "0".
`launch_args(kernel, device)` gives a launch the kernel's PDL constexpr and the option together.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from ._interp import interpreting

ENV = "GRPO_LCE_PDL"
# launches `launch_args` gave PDL, by kernel: tests assert that the PDL path ran
LAUNCHES: collections.Counter = collections.Counter()
_IN_DECODE_STEP = contextvars.ContextVar("grpo_lce_in_decode_step", default=False)


@contextlib.contextmanager
def decode_step():
    """Launches inside the block may use PDL (`pdl_reason`): the decode loop's steps, whose
    kernels never write what a decode kernel reads before its wait."""
    token = _IN_DECODE_STEP.set(True)
    try:
        yield
    finally:
        _IN_DECODE_STEP.reset(token)


@triton.jit
def grid_wait(PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has completed and its writes are visible
    (griddepcontrol.wait; nothing without PDL)."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def let_next_launch(EARLY_NEXT: tl.constexpr):
    """Let the next kernel in the stream start once every program of this one has come here
    (griddepcontrol.launch_dependents), instead of at their exit."""
    if EARLY_NEXT:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)


def next_at_start(args: dict) -> dict:
    """A small kernel's launch arguments (`launch_args`'s) with its NEXT_AT_START: the next
    kernel may launch at this one's start where PDL is on and SMALL_NEXT_AT_START."""
    return {**args, "NEXT_AT_START": bool(args["PDL"]) and SMALL_NEXT_AT_START}


# add_rmsnorm and the decode attention let the next kernel launch at their start (False: at
# their exit; bench.decode_loop's A/B)
SMALL_NEXT_AT_START = True
# the decode linear lets the next kernel start after its K loop when its grid fits this many
# rounds of PROGRAMS_PER_SM programs a SM (0: never; bench.decode_loop's A/B)
EARLY_NEXT_WAVES = 1


def _launcher_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}


@functools.cache
def _device_supports(index: int) -> str | None:
    """Why a CUDA device cannot take PDL launches (None if it can)."""
    major, minor = torch.cuda.get_device_capability(index)
    if major < 9:
        return f"compute capability {major}.{minor} (PDL needs 9.0 or higher)"
    if not _launcher_has_pdl():
        return f"Triton {triton.__version__}'s launcher has no launch_pdl option"
    return None


def pdl_reason(device: torch.device) -> str | None:
    """Why the decode kernels on `device` launch without PDL (None: they launch with it)."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if not _IN_DECODE_STEP.get():
        return "outside a decode step"
    if device.type != "cuda":
        return f"device {device.type}"
    if interpreting():
        return "Triton's interpreter"
    return _device_supports(device.index if device.index is not None
                            else torch.cuda.current_device())


def launch_args(kernel, device: torch.device) -> dict:
    """The keyword arguments of `kernel`'s launch on `device` for PDL: its `PDL` constexpr, and
    Triton's `launch_pdl` option when it is on (older launchers do not know the option)."""
    if pdl_reason(device) is None:
        LAUNCHES[kernel.__name__] += 1
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
