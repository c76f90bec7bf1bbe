"""The decode linear warp-specialized (Hopper): where it runs, and its launch.

`_linear4bit_ws_kernel` (its docstring) streams the packed weight, x and the LoRA factor A
through TMA into shared memory ahead of the warps that look the nibbles up, and runs the
lookup's MMAs from there, so the weight stream no longer waits on the lookups (the register
tile's limit; bench/README.md has the measurements). With the register tables its output
meets `linear4bit`'s bound (the same round(W), fp32 sums in another order, the LoRA term in
fp32); with the pair table (`pair_table_rule`: the long launches, as 8B's gate/up and down)
each weight is round(code) · scale, within P·u·|round(W)| of round(W), P = (2 + u) / (1 - u),
u = 2⁻⁸, which adds P·u·S to each of `linear4bit`'s bounds (its S).

`reason(x, parts, glu, config)` decides, for `linear4bit._launch`: None where this kernel
computes the call. It takes one to three projections of one input in one launch (q/k/v: each
CTA a 64-row tile of one of them, the split rule over all their tiles), or a gate/up + silu ·
mul launch whose split rule gives one split (a group as `linear4bit.group_reason` allows it:
a bias on every projection or none, as Qwen's q/k/v have one); at most 8 rows of bf16 x; K a
multiple of 256 and a blocksize a multiple of 64; a contiguous bias or none; no LoRA or a
rank-16 LoRA with bf16 factors (PEFT's fp32 factors take the register tile, whose fp32
products they need); a CUDA device of compute capability 9.0 with Triton's Gluon; every
operand laid out as TMA reads it; no explicit tile config; and GRPO_LCE_WS_LINEAR not "0". A
launch that fails (Gluon's compiler, a driver) logs one line and turns the path off for the
process.

Inside a decode step the launch uses PDL (`pdl.launch_args` decides): the producer warp copies
the first stages' packed weights and A (which no kernel of the step writes) before it waits
for the previous kernel, then x. Every CTA's producer waits, so the kernel completes only after
the one before it, as `pdl`'s rules ask. A launch of at most EARLY_NEXT_CTAS_PER_SM CTAs a SM
lets the next kernel launch after its K loops (the next kernel's programs wait beside it);
bench/README.md has the A/B that set these.
"""

from __future__ import annotations

import collections
import functools
import logging
import os

import torch
import triton

from ._interp import interpreting
from .lora_t import LoraT
from .split_sum import SplitSum

ENV = "GRPO_LCE_WS_LINEAR"
# "0": no launch takes the pair table (every weight bitsandbytes' round(W) bit for bit)
PAIR_TABLE_ENV = "GRPO_LCE_WS_PAIR_TABLE"
# launches of the kernel, by kind, and by lookup ("pair table", "register tables"): tests
# assert that the path ran
LAUNCHES: collections.Counter = collections.Counter()
LOOKUPS: collections.Counter = collections.Counter()
MAX_ROWS = 8
RANK = 16
# shared-memory stages a CTA streams ahead (`stages`): two, and three for a gate/up + silu · mul
# launch through the pair table (bench/README.md measures both)
STAGES = 2
GLU_PAIR_STAGES = 3
MAXNREG = 128  # registers a thread at launch: two CTAs a SM; the consumer warps take the
#                producer warp group's spare registers
PRODUCER_REGS = 24
# with PDL, a launch of at most this many CTAs a SM lets the next kernel launch once its K
# loops are done (before the epilogue): the next kernel's programs then wait on SMs beside
# them (0: never; 2: every launch, all of whose CTAs are resident). The next kernel launches
# only once every CTA has passed its trigger, so no CTA of this launch waits for its SM slot.
EARLY_NEXT_CTAS_PER_SM = 2.0
# the lookup: through the code's pair table in shared memory (each MMA one chunk, scaled after
# it) or through round(code · scale) tables in registers (byte permutes). 1: the table where a
# projection's lookups are long, at least PAIR_TABLE_MIN_STEPS steps (64 rows x 256 columns) a
# SM (its fill and its shared memory cost more than it saves below that: bench/README.md);
# 0: never; 2: always
PAIR_TABLE = 1
PAIR_TABLE_MIN_STEPS = 16
# the fewest CTAs a launch aims for, per SM (`split_rule`): with the register tables, and with
# the pair table (whose lookups then keep two CTAs a SM busy; bench/README.md)
CTAS_PER_SM = 0.9
PAIR_CTAS_PER_SM = 1.6

_log = logging.getLogger(__name__)
_failed: list[str] = []  # the reason the path is off after a failed launch


@functools.cache
def _gluon_reason() -> str | None:
    try:
        from . import _linear4bit_ws_kernel  # noqa: F401
    except Exception as e:  # noqa: BLE001 (any import failure means no Gluon kernel here)
        return f"Triton {triton.__version__} has no usable Gluon ({type(e).__name__}: {e})"
    return None


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _tma_ready(t: torch.Tensor) -> bool:
    """A 2-D tensor TMA can read: row-major, 16-byte aligned base and row stride."""
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


def _device_reason(device: torch.device) -> str | None:
    """Why a launch on `device` cannot take this kernel (not CUDA, the interpreter, not
    sm_90), or None."""
    if device.type != "cuda" or interpreting():
        return "not a CUDA launch"
    cap = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]} (the kernel is sm_90's)"
    return None


def reason(x: torch.Tensor, parts: list, glu: bool, config: dict | None) -> str | None:
    """Why this kernel does not compute `linear4bit._launch`'s call (None: it does)."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if _failed:
        return _failed[0]
    if config is not None:
        return "an explicit tile config"
    if glu and len(parts) != 2:
        return f"a gate/up launch of {len(parts)} projections (it takes two)"
    if not 1 <= len(parts) <= 3:
        return f"a grouped launch of {len(parts)} projections (it takes 1 to 3)"
    why = _device_reason(x.device)
    if why is not None:
        return why
    m, k = x.shape
    if m > MAX_ROWS or x.dtype != torch.bfloat16 or not _tma_ready(x):
        return f"x {tuple(x.shape)} {x.dtype} (at most {MAX_ROWS} rows of bf16, TMA-aligned)"
    for part in parts:
        why = _part_reason(part, k)
        if why is not None:
            return why
    if glu:
        g, u = parts[0].weight, parts[1].weight
        if ((g.blocksize, g.blocksize2, g.nested, g.quant_type)
                != (u.blocksize, u.blocksize2, u.nested, u.quant_type)):
            return "gate and up quantized differently (the launch holds one code's table)"
        if (parts[0].lora_a is None) != (parts[1].lora_a is None):
            return "LoRA on one of gate and up"
        from .linear4bit import _num_sms

        if split_rule(g.shape[0], k, _num_sms(x.device), CTAS_PER_SM) != 1:
            return "gate/up would split K (the silu · mul launch takes one split)"
    return _gluon_reason()


def given_t_reason(device: torch.device, rows: int, factors: tuple | None) -> str | None:
    """Why a launch of this kernel on `device` for `rows` rows would not take LoRA's t for
    these factors from the kernel before it (`lora_t`), or None: the kernel's device, rows
    and rank, as `reason` asks them (the rest of `reason` is the launch's own)."""
    if factors is None:
        return "a projection without LoRA"
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    why = _device_reason(device)
    if why is not None:
        return why
    if rows > MAX_ROWS:
        return f"{rows} rows (the kernel takes at most {MAX_ROWS})"
    if any(a.shape[0] != RANK or a.dtype != torch.bfloat16 for a in factors):
        return f"LoRA factors other than rank {RANK} in bf16"
    return _gluon_reason()


def _part_reason(part, k: int) -> str | None:
    w = part.weight
    if k % 256 or w.blocksize % 64 or w.packed.data_ptr() % 16:
        return f"K={k}, blocksize {w.blocksize} (multiples of 256 and 64), a 16-byte aligned weight"
    if w.nested and w.blocksize == 64 and w.absmax.data_ptr() % 4:
        return "double-quant absmax not 4-byte aligned"
    if part.bias is not None and part.bias.stride(0) != 1:
        return "a strided bias"
    if part.lora_a is not None:
        a, b = part.lora_a, part.lora_b
        if (a.shape[0] != RANK or a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16
                or not _tma_ready(a) or b.stride(1) != 1):
            return (f"LoRA rank {a.shape[0]}, factors {a.dtype} / {b.dtype} (the kernel takes "
                    f"rank {RANK}, bf16, row-major)")
    return None


def split_rule(n: int, k: int, num_sms: int, ctas_per_sm: float | None = None) -> int:
    """K splits for N output features: the smallest power of two that gives at least
    ctas_per_sm · SMs CTAs of 64 rows (default: PAIR_CTAS_PER_SM where the launch takes the
    pair table, else CTAS_PER_SM), at most 8 and at most half the 256-column steps (each split
    at least two)."""
    tiles = triton.cdiv(n, 64)
    if ctas_per_sm is None:
        ctas_per_sm = (PAIR_CTAS_PER_SM if pair_table_rule(tiles, k, num_sms)
                       else CTAS_PER_SM)
    split = 1
    while tiles * split < ctas_per_sm * num_sms and split < 8:
        split *= 2
    return max(1, min(split, (k // 256) // 2))


def pair_table_rule(tiles: int, k: int, num_sms: int) -> bool:
    """Whether a launch of `tiles` 64-row tiles over K (a gate/up launch: one projection's)
    looks its nibbles up in the pair table (PAIR_TABLE; never with GRPO_LCE_WS_PAIR_TABLE=0).
    By one projection's steps, so that a gate/up launch and its projections alone agree."""
    if os.environ.get(PAIR_TABLE_ENV, "1") == "0":
        return False
    if PAIR_TABLE != 1:
        return PAIR_TABLE == 2
    return tiles * (k // 256) >= PAIR_TABLE_MIN_STEPS * num_sms


def stages(glu: bool, pair_table: bool) -> int:
    """The ring's depth of a launch: GLU_PAIR_STAGES for a gate/up + silu · mul launch through
    the pair table (its two K loops of one split stream the most steps a CTA), else STAGES."""
    return GLU_PAIR_STAGES if glu and pair_table else STAGES


def _descriptor(t: torch.Tensor, shape: list, strides: list, block: list, bits: int):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=bits,
                                  rank=len(block))
    return TensorDescriptor(t, shape, strides, block, layout)


@functools.cache
def _no_lora(device: torch.device) -> torch.Tensor:
    """A stand-in for A without LoRA (its descriptor is passed, never read)."""
    return torch.zeros(RANK, 256, device=device, dtype=torch.bfloat16)


def launch(x: torch.Tensor, parts: list, glu: bool, defer_sum: bool,
           lora_t: LoraT | None = None) -> list | None:
    """[y_s] for each of the parts (`reason` None; column slices of one (M, Σ N_s) output), or
    [SplitSum_s] where `defer_sum` and K is split; with `glu` (parts gate, up) [silu(gate) ·
    up]. `lora_t`: LoRA's t of x and the parts' factors (`lora_t.LoraT`), summed by the
    epilogue instead of formed in the K loop (`linear4bit._launch` checked it is x's and the
    parts'). None if the launch failed (logged once; the path is then off)."""
    try:
        return _launch(x, parts, glu, defer_sum, lora_t=lora_t)
    except Exception as e:  # noqa: BLE001 (a fast path that fails falls back, with one line)
        msg = f"warp-specialized decode linear failed ({type(e).__name__}: {e})"
        _failed.append(msg)
        _log.warning("%s; using the register tile from now on", msg)
        return None


def _part_args(part, x: torch.Tensor) -> list:
    """A projection's kernel arguments (one segment's): the packed weight's descriptor, A's, B,
    the code, the absmax, the second-level scale, code and offset, the LoRA scaling, B's row
    stride, N and the bias (x in its place where there is none: never read)."""
    w = part.weight
    n, k = w.shape
    words = w.packed.view(torch.int32).view(n, k // 8)
    has_lora = part.lora_a is not None
    a = part.lora_a if has_lora else _no_lora(x.device)
    # A (and x) as (rows, K / 64, 64): a step's box is every row's 4 chunks of 64 columns
    return [_descriptor(words, [n, k // 8], [k // 8, 1], [64, 32], 32),
            _descriptor(a, [RANK, a.shape[1] // 64, 64], [a.stride(0), 64, 1], [RANK, 4, 64],
                        16),
            part.lora_b if has_lora else x, w.code, w.absmax,
            w.absmax2 if w.nested else w.code, w.code2 if w.nested else w.code,
            w.offset if w.nested else w.code, float(part.scaling),
            part.lora_b.stride(0) if has_lora else 0, n,
            part.bias if part.bias is not None else x]


def _launch(x: torch.Tensor, parts: list, glu: bool, defer_sum: bool,
            split: int | None = None, lora_t: LoraT | None = None) -> list:
    """`launch` without its fallback; `split` (default `split_rule`'s) for the lab's sweeps."""
    from ._linear4bit_ws_kernel import linear4bit_ws_kernel
    from .linear4bit import _num_sms, _split_k_reduce_kernel, split_steps
    from .pdl import launch_args

    m, k = x.shape
    w = parts[0].weight
    ns = [p.weight.shape[0] for p in parts]
    tiles = [triton.cdiv(n, 64) for n in ns[:1 if glu else None]]
    sms = _num_sms(x.device)
    split = 1 if glu else split or split_rule(64 * sum(tiles), k, sms)
    per, split = split_steps(k // 256, split)
    # rows past M read as zeros
    x_desc = _descriptor(x, [m, k // 64, 64], [x.stride(0), 64, 1], [8, 4, 64], 16)
    segs = [_part_args(p, x) for p in parts]
    segs += [segs[-1]] * (3 - len(segs))  # absent segments repeat the last (never selected)
    # a segment's first tile and output column; past the grid where it is absent (or GLU's up)
    beyond = sum(tiles)
    first_tile = [sum(tiles[:i]) if i < len(tiles) else beyond for i in (1, 2)]
    width = ns[0] if glu else sum(ns)
    first_col = [sum(ns[:i]) if i < len(tiles) else 0 for i in (1, 2)]
    y = torch.empty(m, width, device=x.device, dtype=x.dtype)
    partials = (torch.empty(split, m, width, device=x.device, dtype=torch.float32)
                if split > 1 else y)
    pair_table = pair_table_rule(sum(tiles), k, sms)
    has_lora = parts[0].lora_a is not None
    t = lora_t.parts if lora_t is not None and has_lora else None  # (P, J·16, M) fp32
    linear4bit_ws_kernel[(sum(tiles), split)](
        x_desc, y, partials, t if t is not None else partials,
        t.stride(0) if t is not None else 0, t.stride(1) if t is not None else 0,
        *segs[0], *segs[1], *segs[2], *first_tile, *first_col,
        k, m, y.stride(0), partials.stride(1), partials.stride(0) if split > 1 else 0, per,
        BS=w.blocksize, BS2=w.blocksize2, NESTED=w.nested, SPLIT=split > 1,
        STAGES=stages(glu, pair_table),
        HAS_LORA=has_lora, HAS_BIAS=parts[0].bias is not None, GLU=glu,
        PRODUCER_REGS=PRODUCER_REGS, PAIR_TABLE=pair_table,
        T_PARTS=t.shape[0] if t is not None else 0,
        **(pdl_args := launch_args(linear4bit_ws_kernel, x.device)),
        EARLY_NEXT=pdl_args["PDL"] and sum(tiles) * split <= EARLY_NEXT_CTAS_PER_SM * sms,
        num_warps=4, maxnreg=MAXNREG,
        # the double-quant scale code2 · absmax2 + offset with bitsandbytes' two roundings
        enable_fp_fusion=False)
    LAUNCHES["silu_mul" if glu else ("split" if split > 1 else "whole")
             + (f" x{len(parts)}" if len(parts) > 1 else "")] += 1
    LOOKUPS["pair table" if pair_table else "register tables"] += 1
    if t is not None:
        LAUNCHES["lora t given"] += 1
    cols = [sum(ns[:i]) for i in range(len(ns))]
    if split == 1:
        return [y] if glu else [y[:, c:c + n] for c, n in zip(cols, ns)]
    if defer_sum:
        return [SplitSum(partials[:, :, c:c + n], p.bias, x.dtype, n)
                for c, n, p in zip(cols, ns, parts)]
    if parts[0].bias is None:  # one sum over every projection's columns
        _split_k_reduce_kernel[(1, triton.cdiv(width, 64))](
            partials, y, y, m, width, split, partials.stride(0), partials.stride(1),
            y.stride(0), HAS_BIAS=False, BLOCK_M=16, BLOCK_N=64, INTERP=False)
        return [y[:, c:c + n] for c, n in zip(cols, ns)]
    outs = [y[:, c:c + n] for c, n in zip(cols, ns)]
    for c, n, p, o in zip(cols, ns, parts, outs):  # a sum a projection, each its bias
        _split_k_reduce_kernel[(1, triton.cdiv(n, 64))](
            partials[:, :, c:c + n], p.bias, o, m, n, split, partials.stride(0),
            partials.stride(1), o.stride(0), HAS_BIAS=True, BLOCK_M=16, BLOCK_N=64,
            INTERP=False)
    return outs
