"""The decode linear: a bitsandbytes 4-bit weight times a few rows, with the LoRA term fused.

x (M, K) in the compute dtype (bf16 or fp16), M ≤ 256 (decode batches); the weight W (N, K) as
bitsandbytes stores it (NF4 or FP4, `Params4bit`):

    packed (N·K/2,) uint8: element e = n·K + k sits in byte e // 2, high nibble for even e
    code (16,) fp32:       the NF4 or FP4 value of each 4-bit index
    absmax (N·K/BS,):      one fp32 scale per block of BS consecutive elements (K % BS == 0 here,
                           so a block never straddles two rows), or, with double quant,
                           absmax[b] = code2[qabs[b]] · absmax2[b // 256] + offset   (all fp32)
    W[n, k] = code[q(n, k)] · absmax[(n·K + k) // BS]                                  (fp32)

    y = x @ round(W)ᵀ + bias + s · (x @ Aᵀ) @ Bᵀ,    A (r, K), B (N, r), s = α / r

round(W) is W rounded to x's dtype, exactly the weight bitsandbytes' `dequantize_4bit` hands to
its bf16 matmul (it forms code · absmax in fp32 and casts). The products x · round(W) are exact
in fp32 and summed in fp32; the LoRA term is fp32 throughout (t = x @ Aᵀ is never rounded); the
output is rounded once. Against bitsandbytes + PEFT in bf16 (which also rounds t, tBᵀ, s·tBᵀ and
the base output to bf16), with u = 2⁻⁸ the bf16 unit roundoff and S = |x| @ |round(W)|ᵀ +
|s| · (|x| @ |A|ᵀ) @ |B|ᵀ, the difference is at most

    |ours − ref| ≤ 4u · |y| + (4u + 2K · 2⁻²⁴) · S

(4u: the reference's roundings of t, t·Bᵀ, s·t·Bᵀ, base and sum; ours and theirs each round the
output once; 2K · 2⁻²⁴ bounds the two fp32 accumulations.) Against the same sum in fp64 with the
same round(W), ours is off by at most u · |y| + 2K · 2⁻²⁴ · S.

Memory: the packed weight is read once, never expanded to a bf16 copy in memory; A and B are
read from their storage at every call, so a captured CUDA graph sees each optimizer step's
values. One launch: when the K loop is split over programs, each writes its partial output
(SPLIT_K, M, N) fp32 and the last split of each output tile to arrive sums them in split order
(the same bits as a second reduction launch, which `LAST_REDUCES=False` keeps), or, asked
with `defer_sum`, hands the partials on as a `split_sum.SplitSum` for the kernel that reads y
next to sum the same way (the decode step's q/k/v into RoPE, o and down into RMSNorm). Each
split carries its own LoRA term s · t_split @ Bᵀ, t_split = x[:, split] @ A[:, split]ᵀ: the
term is linear in t, so the splits add up to s · t @ Bᵀ, and every sum stays fp32 (no chain
longer than K + r + SPLIT_K terms).

Up to 16 rows (and a blocksize that is a multiple of 64) the K loop forms each weight tile in
registers, in the layout the warpgroup MMA takes its left operand in, with K permuted so that
the bytes a thread loads are its operand registers (`_reg_tile_loop`, REG_TILE); above, one
absmax block a step, the tile moved into that layout through shared memory. Either sum is fp32 in some order of K: the bound above
holds for any order.

On an sm_90 GPU, one to three projections of at most 8 rows (q/k/v), or a gate/up + silu · mul
launch, with or without a bias and with no LoRA or a rank-16 bf16 one, takes `linear4bit_ws`'s
kernel instead (its
docstring: the weight streamed through TMA into shared memory ahead of the lookups; the same
round(W) and bound, or for its long launches weights within (2 + u) / (1 - u) · u of round(W),
which adds that times S to each bound); `_launch` asks it first.

Projections of the same x (q/k/v, gate/up) can share that launch (`linear4bit_lora_group`,
`decode_linears`): the grid's output tiles run over each projection's rows in turn, and each
output is bit for bit what the projection gives alone with the same tiles and lookup. A gate/up
launch can also form the MLP's silu(gate) · up itself (`linear4bit_lora_silu_mul`,
`decode_silu_mul`): the last program of each pair of gate and up tiles sums both and writes
torch's silu · mul of the two rounded outputs, so neither projection's output goes to memory.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..kernels._interp import dot, interpreting, to_dtype
from . import linear4bit_ws, pdl
from .arrivals import arrival_counters
from .lora_t import LoraT
from .pdl import grid_wait, launch_args, let_next_launch
from .split_sum import SplitSum


def _table_asm(cvt: str) -> str:
    """PTX: the 16 entries round(code[i] · scale) of one row's absmax block (`cvt` rounds two fp32
    to two 16-bit floats, nearest even), as two byte planes of four words: $0..$3 hold the low
    bytes of entries 4j .. 4j + 3, $4..$7 their high bytes. Inputs: $8 the scale, $9 + i code[i].
    The products are fp32 (mul.rn, never fused), as bitsandbytes forms them."""
    lines = [f"mul.rn.f32 p{i}, ${9 + i}, $8;" for i in range(16)]
    # w_j = {entry 2j + 1 (upper half), entry 2j (lower half)}: bytes [e2j.lo, e2j.hi, ...]
    lines += [f"{cvt} w{j}, p{2 * j + 1}, p{2 * j};" for j in range(8)]
    lines += [f"prmt.b32 ${j}, w{2 * j}, w{2 * j + 1}, 0x6420;" for j in range(4)]  # low bytes
    lines += [f"prmt.b32 ${4 + j}, w{2 * j}, w{2 * j + 1}, 0x7531;" for j in range(4)]  # high
    return "{\n.reg .f32 p<16>;\n.reg .b32 w<8>;\n" + "\n".join(lines) + "\n}"


def _dequant_asm(pairs: bool = False) -> str:
    """PTX, one 32-bit word of packed bytes of one row at a time ($4, byte 0 in its low bits;
    pack=1). Operands: $0 .. $3 four words of two 16-bit floats each (below), $5 .. $12 the
    row's table words of `_table_asm`. The word is loaded as one 32-bit value and the outputs
    are whole registers, so no byte or half-word is unpacked and repacked around the lookup.
    prmt picks 4 bytes out of 8 by 3-bit selectors: the 4 nibbles of a byte pair select in
    entries 0-7 and in 8-15 (bit 3 cleared: it is prmt's sign-replicate flag), then each
    nibble's bit 3 picks between the two, for the low-byte plane and the high-byte plane; two
    more permutes pair each value's bytes.

    Outputs, the lower half holding the first value: by default $0, $1 the high nibbles'
    values (even elements) of bytes 0-1 and 2-3, $2, $3 the low nibbles' (odd elements); with
    `pairs`, $i the two values of byte i (elements 2i, 2i + 1: consecutive along K)."""
    # The selectors take 2 ALU instructions a word; the shifts run as mul.hi on the FMA pipe
    # (x · 2^(32 - k) >> 32 = x >> k), which the lookup's PRMTs (the ALU pipe) leave idle.
    lines = ["and.b32 s, $4, 0x77777777;",  # 3-bit entry index within a half of the table
             "mul.hi.u32 m, $4, 0x80000000;",  # $4 >> 1
             # m's nibble i: byte i of a (entries 0-7) or 4 + i (b): (m & 0x4...) | 0x3210...
             "lop3.b32 m, m, 0x44444444, 0x32103210, 0xEA;"]
    word = [f"${5 + w}" for w in range(8)]
    # l, h: bytes [lo(b), hi(b), lo(b+1), hi(b+1)] of the low / high byte plane, b = 2 · half
    outs = ((("$0", "0x7351"), ("$2", "0x6240")), (("$1", "0x7351"), ("$3", "0x6240")))
    if pairs:  # byte b's high nibble (element 2b) in the lower half, its low nibble above
        outs = ((("$0", "0x4051"), ("$1", "0x6273")), (("$2", "0x4051"), ("$3", "0x6273")))
    for half in range(2):
        if half:  # bytes 2-3: prmt reads the selector's low 16 bits (>> 16 by mul.hi)
            lines += ["mul.hi.u32 s, s, 0x10000;", "mul.hi.u32 m, m, 0x10000;"]
        for plane, dst in ((word[:4], "l"), (word[4:], "h")):
            lines += [f"prmt.b32 a, {plane[0]}, {plane[1]}, s;",
                      f"prmt.b32 b, {plane[2]}, {plane[3]}, s;",
                      f"prmt.b32 {dst}, a, b, m;"]
        lines += [f"prmt.b32 {out}, l, h, {sel};" for out, sel in outs[half]]
    return "{\n.reg .b32 s, m, a, b, l, h;\n" + "\n".join(lines) + "\n}"


_DEQUANT_ASM = _dequant_asm()
_PAIRS_ASM = _dequant_asm(pairs=True)
_TABLE_BF16 = tl.constexpr(_table_asm("cvt.rn.bf16x2.f32"))
_TABLE_F16 = tl.constexpr(_table_asm("cvt.rn.f16x2.f32"))
_TABLE_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 17))
_DEQUANT = tl.constexpr(_DEQUANT_ASM)
_PAIRS = tl.constexpr(_PAIRS_ASM)
_DEQUANT_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 9))


@triton.jit
def _halves(w, dtype: tl.constexpr):
    """The two 16-bit floats of each int32 word w (lower half first) along a new last axis."""
    lo = (w & 0xFFFF).to(tl.int16).to(dtype, bitcast=True)
    hi = (w >> 16).to(tl.int16).to(dtype, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _code_table(scale, code_ptr, dtype: tl.constexpr):
    """The 8 words of `_table_asm` (round(code · scale) as byte planes) of each scale."""
    c0 = tl.load(code_ptr + 0)
    c1 = tl.load(code_ptr + 1)
    c2 = tl.load(code_ptr + 2)
    c3 = tl.load(code_ptr + 3)
    c4 = tl.load(code_ptr + 4)
    c5 = tl.load(code_ptr + 5)
    c6 = tl.load(code_ptr + 6)
    c7 = tl.load(code_ptr + 7)
    c8 = tl.load(code_ptr + 8)
    c9 = tl.load(code_ptr + 9)
    c10 = tl.load(code_ptr + 10)
    c11 = tl.load(code_ptr + 11)
    c12 = tl.load(code_ptr + 12)
    c13 = tl.load(code_ptr + 13)
    c14 = tl.load(code_ptr + 14)
    c15 = tl.load(code_ptr + 15)
    if dtype == tl.bfloat16:
        table_asm: tl.constexpr = _TABLE_BF16
    else:
        table_asm: tl.constexpr = _TABLE_F16
    return tl.inline_asm_elementwise(
        table_asm, _TABLE_CONSTRAINTS,
        [scale, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32,
               tl.int32), is_pure=True, pack=1)


@triton.jit
def _words_to_values(w01, w23, dtype: tl.constexpr, BLOCK_N: tl.constexpr, HB: tl.constexpr):
    """(BLOCK_N, HB) values in dtype from words (BLOCK_N, HB // 4) int32 holding the values of
    bytes 4c, 4c + 1 (w01, lower half first) and 4c + 2, 4c + 3 (w23): element 4c + 2i + k is
    half k of word i (the same bits, rearranged in registers)."""
    z = tl.join(_halves(w01, dtype), _halves(w23, dtype))  # z[n, c, k, i]: half k of word i
    return tl.reshape(tl.permute(z, (0, 1, 3, 2)), (BLOCK_N, HB))


@triton.jit
def _dequant_prmt(p, scale, code_ptr, dtype: tl.constexpr, BLOCK_N: tl.constexpr,
                  HB: tl.constexpr):
    """(high nibbles, low nibbles) of the packed bytes of each row, p (BLOCK_N, HB // 4) int32
    words, as round(code[q] · scale[n]) in dtype, each (BLOCK_N, HB): one table of 16 values
    per row, then register byte permutes (no memory lookups per element)."""
    lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3 = _code_table(scale, code_ptr, dtype)
    args = [p, lo0[:, None], lo1[:, None], lo2[:, None], lo3[:, None],
            hi0[:, None], hi1[:, None], hi2[:, None], hi3[:, None]]
    hi01, hi23, lo01, lo23 = tl.inline_asm_elementwise(
        _DEQUANT, _DEQUANT_CONSTRAINTS, args, dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True, pack=1)
    return (_words_to_values(hi01, hi23, dtype, BLOCK_N, HB),
            _words_to_values(lo01, lo23, dtype, BLOCK_N, HB))


@triton.jit
def _reg_tile_kmap():
    """(128,) the K offset within a half step of each column k' of a register tile (below)."""
    kp = tl.arange(0, 128)
    kmap = 64 * ((kp >> 1) & 3) + 4 * (kp >> 4) + 2 * ((kp >> 3) & 1) + (kp & 1)
    return tl.max_contiguous(tl.multiple_of(kmap, 2), 2)  # consecutive pairs


@triton.jit
def _reg_tile_prmt(p, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, dtype: tl.constexpr):
    """The (64, 128) register tile of half a step from p, its packed words [Q, R8, W, RB, JL]
    (`_reg_tile_loop`), and each row and chunk's table words (`_code_table`): the pairs
    lookup (`_dequant_asm(pairs=True)`), then joins, a permute and a reshape that only rename
    registers (the layouts are the MMA operand's)."""
    b0, b1, b2, b3 = tl.inline_asm_elementwise(
        _PAIRS, _DEQUANT_CONSTRAINTS, [p, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    # byte 2G + H of word JL: [Q, R8, W, RB, JL] + [E, H, G]
    v = tl.join(tl.join(_halves(b0, dtype), _halves(b1, dtype)),
                tl.join(_halves(b2, dtype), _halves(b3, dtype)))
    # rows W·16 + RB·8 + R8; columns k' = JL·32 + G·16 + H·8 + Q·2 + E
    return tl.reshape(tl.permute(v, (2, 3, 1, 4, 7, 6, 0, 5)), (64, 128))


@triton.jit
def _reg_tile_words(w_words, row, row_ok, KC, step, half, q, jl, EVEN_K: tl.constexpr):
    """The packed words [Q, R8, W, RB, JL] of half `half` of a step: word 4·half + JL of chunk
    4·step + Q of each row (zero past K or N)."""
    chunk = step * 4 + q
    ok = row_ok & ((chunk < KC) | EVEN_K)
    return tl.load(w_words + (row * KC + chunk) * 8 + half * 4 + jl, mask=ok, other=0)


@triton.jit
def _reg_tile_scale_operands(absmax_ptr, absmax2_ptr, row, row_ok, KC, K, step, q,
                             BS: tl.constexpr, BS2: tl.constexpr, NESTED: tl.constexpr,
                             EVEN_K: tl.constexpr):
    """`_scale_operands` of each row and chunk of a step, [Q, R8, W, RB, 1]."""
    chunk = step * 4 + q
    ok = row_ok & ((chunk < KC) | EVEN_K)
    return _scale_operands(absmax_ptr, absmax2_ptr, row * (K // BS) + chunk // (BS // 64), ok,
                           BS2, NESTED)


@triton.jit
def _reg_tile_loop(acc, t, w_ptr, code_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset,
                   x_ptr, a_ptr, tile_row0, N, K, offs_m, m_ok, offs_r, r_ok, step_lo, step_hi,
                   stride_xm, stride_ar, BS: tl.constexpr, BS2: tl.constexpr,
                   NESTED: tl.constexpr, HAS_LORA: tl.constexpr, LORA_FP32: tl.constexpr,
                   PRMT: tl.constexpr, PREFETCH: tl.constexpr, EVEN_K: tl.constexpr,
                   PDL: tl.constexpr, INTERP: tl.constexpr):
    """The K loop of a 64-row tile on 4 warps with the dequantized weight formed in registers
    in the layout the warpgroup MMA takes its left operand in, so it never goes through
    shared memory. One step covers 256 columns of K: four chunks of 64 elements (32 packed
    bytes of a row each), taken in two halves of 128 columns (one dot each, so only half the
    tile is live at once). A dot sums over K in any order as long as x is read in the same
    one, so a half's columns are K permuted (column k' of half h reads K offset 32·h + kmap(k')
    of the step, `_reg_tile_kmap`) such that each thread's operand registers are exactly the
    bytes it loads: in the MMA's operand layout a thread holds rows r and r + 8, and in every
    16 columns the pairs at 2·(lane % 4) and 2·(lane % 4) + 8. Here lane % 4 picks the chunk Q, a thread loads 16
    bytes of its chunk for both rows (one 16-byte load each), and byte b of those (elements
    2b, 2b + 1, one register after the lookup) sits at column k' with b = 2·(k' >> 4) +
    ((k' >> 3) & 1):

        kmap(k') = 64·Q + 4·(k' >> 4) + 2·((k' >> 3) & 1) + E,   Q = (k' >> 1) & 3, E = k' & 1

    (the half's 16 bytes are bytes 16·half .. 16·half + 15 of the chunk, at K offset 32·half
    within it). The words are loaded as a 5-D tensor [Q, R8, W, RB, JL] (chunk, row bits 0-2,
    warp, row bit 3, 4 words), whose default blocked layout (4 words a thread, lanes over Q
    then R8, warps over W) is that operand layout once the lookup's outputs are joined: the
    compiler keeps it in registers. A chunk lies in one absmax block (BS % 64 == 0), so each
    thread forms one table per row and chunk and step, for both halves. Unless K is a multiple
    of 256 (EVEN_K), chunks past K are masked (x is zero there). The interpreter's path
    gathers each nibble into the same tile (PRMT False). The first step's words and scale
    operands are loaded before `grid_wait` (PDL: they are weights, which the kernel before
    this one does not write), x and A after it."""
    q = tl.arange(0, 4)[:, None, None, None, None]
    r8 = tl.arange(0, 8)[None, :, None, None, None]
    wv = tl.arange(0, 4)[None, None, :, None, None]
    rb = tl.arange(0, 2)[None, None, None, :, None]
    jl = tl.arange(0, 4)[None, None, None, None, :]
    row = tile_row0 + wv * 16 + rb * 8 + r8  # [1, R8, W, RB, 1]
    row_ok = row < N
    KC = K // 64  # chunks per row
    w_words = w_ptr.to(tl.pointer_type(tl.int32))
    kmap = _reg_tile_kmap()
    rows2 = tile_row0 + tl.arange(0, 64)  # the gathers' rows, in tile order
    dtype = x_ptr.dtype.element_ty
    # the LoRA factor t = x @ Aᵀ of the step as a batched dot over its 4 chunks, so each warp
    # holds one chunk's operands (a single dot would give every warp all of them), summed
    # over the batch after the loop
    chunk_k = tl.arange(0, 4)[:, None, None] * 64 + tl.arange(0, 64)[None, None, :]
    t4 = tl.zeros((4, t.shape[0], t.shape[1]), dtype=tl.float32)
    if PRMT and PREFETCH:
        p0_next = _reg_tile_words(w_words, row, row_ok, KC, step_lo, 0, q, jl, EVEN_K)
        p1_next = _reg_tile_words(w_words, row, row_ok, KC, step_lo, 1, q, jl, EVEN_K)
        qa_next, a2_next = _reg_tile_scale_operands(absmax_ptr, absmax2_ptr, row, row_ok, KC, K,
                                                    step_lo, q, BS, BS2, NESTED, EVEN_K)
    grid_wait(PDL)
    for step in range(step_lo, step_hi):
        if PRMT:
            if PREFETCH:
                p0, p1, qa, a2 = p0_next, p1_next, qa_next, a2_next
                nxt = tl.minimum(step + 1, step_hi - 1)
                p0_next = _reg_tile_words(w_words, row, row_ok, KC, nxt, 0, q, jl, EVEN_K)
                p1_next = _reg_tile_words(w_words, row, row_ok, KC, nxt, 1, q, jl, EVEN_K)
                qa_next, a2_next = _reg_tile_scale_operands(
                    absmax_ptr, absmax2_ptr, row, row_ok, KC, K, nxt, q, BS, BS2, NESTED, EVEN_K)
            else:
                p0 = _reg_tile_words(w_words, row, row_ok, KC, step, 0, q, jl, EVEN_K)
                p1 = _reg_tile_words(w_words, row, row_ok, KC, step, 1, q, jl, EVEN_K)
                qa, a2 = _reg_tile_scale_operands(absmax_ptr, absmax2_ptr, row, row_ok, KC, K,
                                                  step, q, BS, BS2, NESTED, EVEN_K)
            lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3 = _code_table(
                _scale(qa, a2, code2_ptr, offset, NESTED), code_ptr, dtype)
        for half in tl.static_range(2):
            kk = step * 256 + half * 32 + kmap  # (128,) the K index of each tile column
            k_ok = (kk < K) | EVEN_K
            if PRMT:
                if half == 0:
                    wt = _reg_tile_prmt(p0, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, dtype)
                else:
                    wt = _reg_tile_prmt(p1, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, dtype)
            else:  # the same tile, one gather per nibble (high nibble = even element)
                ok2 = (rows2 < N)[:, None] & k_ok[None, :]
                byte = tl.load(w_ptr + rows2[:, None] * (K // 2) + kk[None, :] // 2, mask=ok2,
                               other=0)
                nib = tl.where((kk & 1)[None, :] == 0, byte >> 4, byte & 15)
                qa2, a22 = _scale_operands(absmax_ptr, absmax2_ptr,
                                           rows2[:, None] * (K // BS) + kk[None, :] // BS, ok2,
                                           BS2, NESTED)
                c = tl.load(code_ptr + nib.to(tl.int32))
                wt = to_dtype(c * _scale(qa2, a22, code2_ptr, offset, NESTED), dtype, INTERP)
            xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                         mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc += dot(wt, tl.trans(xt), INTERP)
        if HAS_LORA:  # the step's 4 chunks in natural order, one batch (and warp) each
            kb = step * 256 + chunk_k  # [4, 1, 64]
            kb_ok = (kb < K) | EVEN_K
            x3 = tl.load(x_ptr + offs_m[None, :, None] * stride_xm + kb,
                         mask=m_ok[None, :, None] & kb_ok, other=0.0)  # [4, BLOCK_M, 64]
            kt = tl.permute(kb, (0, 2, 1))  # [4, 64, 1]
            a3 = tl.load(a_ptr + offs_r[None, None, :] * stride_ar + kt,
                         mask=r_ok[None, None, :] & ((kt < K) | EVEN_K), other=0.0)
            if LORA_FP32:  # PEFT casts x to A's dtype: fp32 products
                t4 += tl.dot(x3.to(tl.float32), a3.to(tl.float32), input_precision="ieee")
            else:
                t4 += dot(x3, a3, INTERP)
    if HAS_LORA:
        t += tl.sum(t4, axis=0)
    return acc, t


@triton.jit
def _sum_splits(acc, part_ptr, offs, mask, splits, stride_ps):
    """acc (zeros) + part[0] + part[1] + ... in split order, fp32: every split-K reduction
    (these two and `split_sum.load_sum`) sums this way, so they give the same bits. Read from L2
    (.cg): other programs wrote the parts."""
    for s in range(splits):
        acc += tl.load(part_ptr + s * stride_ps + offs, mask=mask, other=0.0,
                       cache_modifier=".cg")
    return acc


@triton.jit
def _silu_mul(g, u, dtype: tl.constexpr, INTERP: tl.constexpr):
    """round(silu(round(g)) · round(u)) from the fp32 sums g, u: what torch gives for
    `F.silu(gate) * up` on the projections' rounded outputs. torch's silu forms
    x / (1 + exp(−x)) in fp32 (libdevice's expf, an IEEE division) and rounds; the product of two
    16-bit values is exact in fp32 and rounded once. (The interpreter has no libdevice: its exp
    is numpy's, within the same 2 ulps.)"""
    g = to_dtype(g, dtype, INTERP).to(tl.float32)
    u = to_dtype(u, dtype, INTERP).to(tl.float32)
    if INTERP:
        e = tl.exp(-g)
    else:
        e = libdevice.exp(-g)
    s = to_dtype(tl.math.div_rn(g, 1.0 + e), dtype, INTERP).to(tl.float32)
    return to_dtype(s * u, dtype, INTERP)


@triton.jit
def _split_k_reduce_kernel(
    part_ptr, bias_ptr, y_ptr, M, N, SPLIT_K, stride_ps, stride_pm, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr,
):
    """y = round(Σ_s part[s] + bias), the splits summed in a fixed order (deterministic)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    acc = _sum_splits(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), part_ptr,
                      offs_m[:, None] * stride_pm + offs_n[None, :], mask, SPLIT_K, stride_ps)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             to_dtype(acc, y_ptr.dtype.element_ty, INTERP), mask=mask)


@triton.jit
def _scale_operands(absmax_ptr, absmax2_ptr, ablk, n_ok, BS2: tl.constexpr,
                    NESTED: tl.constexpr):
    """What the fp32 scale (BLOCK_N,) of absmax block `ablk` of each row is formed from (ablk
    (BLOCK_N,) int64, the flat block index): with double quant (the uint8 code index, the
    second-level fp32 scale), else (the fp32 absmax, the same again)."""
    if NESTED:
        qa = tl.load(absmax_ptr + ablk, mask=n_ok, other=0)
        return qa, tl.load(absmax2_ptr + ablk // BS2, mask=n_ok, other=0.0)
    else:
        a = tl.load(absmax_ptr + ablk, mask=n_ok, other=0.0)
        return a, a


@triton.jit
def _scale(qa, a2, code2_ptr, offset, NESTED: tl.constexpr):
    """The fp32 scale from `_scale_operands`: code2[qa] · absmax2 + offset (a product, then an
    add: bitsandbytes' two roundings), or the absmax itself. code2 is 1 KB: an L1 gather."""
    if NESTED:
        return tl.load(code2_ptr + qa.to(tl.int32)) * a2 + offset
    else:
        return qa


@triton.jit
def _block_bytes(w_ptr, ablk, offs_j, n_ok, HB: tl.constexpr, WORDS: tl.constexpr):
    """The packed bytes of absmax block `ablk` of each row: contiguous per row, the only
    traffic that scales with N·K. (BLOCK_N, HB) uint8, or with WORDS (BLOCK_N, HB // 4) int32
    words of four bytes each (a row's HB bytes start 4-byte aligned: the launcher checks the
    weight's address)."""
    if WORDS:
        offs_w = tl.arange(0, HB // 4)
        p = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + (ablk * (HB // 4))[:, None]
                    + offs_w[None, :], mask=n_ok[:, None], other=0)
    else:
        p = tl.load(w_ptr + (ablk * HB)[:, None] + offs_j[None, :], mask=n_ok[:, None], other=0)
    return p


@triton.jit
def _x_and_a_block(x_ptr, a_ptr, offs_m, m_ok, offs_r, r_ok, k_blk, stride_xm, stride_ar,
                   HAS_LORA: tl.constexpr):
    """x[:, k_blk] (BLOCK_M, BS) and, with LoRA, A[:, k_blk] (BLOCK_R, BS) (else x's again),
    each loaded contiguously (split into even and odd columns where they are used)."""
    xb = tl.load(x_ptr + offs_m[:, None] * stride_xm + k_blk[None, :], mask=m_ok[:, None],
                 other=0.0)
    if HAS_LORA:
        return xb, tl.load(a_ptr + offs_r[:, None] * stride_ar + k_blk[None, :],
                           mask=r_ok[:, None], other=0.0)
    else:
        return xb, xb


@triton.jit
def _seg(v0, v1, v2, in1, in2, SEGS: tl.constexpr):
    """v0, v1 or v2: the value of the projection (segment) this program computes (in1 / in2:
    it is in segment 1 / 2)."""
    if SEGS == 1:
        return v0
    elif SEGS == 2:
        return tl.where(in1, v1, v0)
    else:
        return tl.where(in2, v2, tl.where(in1, v1, v0))


@triton.jit
def _linear4bit_lora_kernel(
    x_ptr, y_ptr, part_ptr, count_ptr,
    w_0, code_0, absmax_0, code2_0, absmax2_0, offset_0, a_0, b_0, bias_0,
    w_1, code_1, absmax_1, code2_1, absmax2_1, offset_1, a_1, b_1, bias_1,
    w_2, code_2, absmax_2, code2_2, absmax2_2, offset_2, a_2, b_2, bias_2,
    N_0, N_1, N_2, scaling_0, scaling_1, scaling_2, TILE_1, TILE_2, COL_1, COL_2,
    M, K, R, BLOCKS_PER_SPLIT,
    stride_xm, stride_ar, stride_bn, stride_ym, stride_ps, stride_pm,
    SEGS: tl.constexpr, BS: tl.constexpr, BS2: tl.constexpr, NESTED: tl.constexpr,
    HAS_LORA: tl.constexpr, LORA_FP32: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr, LAST_REDUCES: tl.constexpr, GLU: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    PRMT: tl.constexpr, PREFETCH: tl.constexpr, REG_TILE: tl.constexpr, EVEN_K: tl.constexpr,
    PDL: tl.constexpr, EARLY_NEXT: tl.constexpr, INTERP: tl.constexpr,
):
    """One launch for SEGS projections of the same x (two with LAST_REDUCES off): segment s's
    weight, quantization state, LoRA factors and bias are the arguments ending in _s, its
    output columns y[:, COL_s : COL_s + N_s] (COL_0 = 0) and its n-tiles the programs from
    TILE_s on along axis 1 (TILE_0 = 0); a program computes one tile of one segment.

    With REG_TILE the K loop is `_reg_tile_loop`'s (its docstring); what follows describes the
    block-a-step loop, and the accumulators, LoRA term and epilogue both share.

    The output tile is held transposed, accT (BLOCK_N, BLOCK_M) = y[m-block, n-block]ᵀ, so
    that the dequantized weight tile is the left operand of the dot: the compiler then moves it
    into the MMA's operand layout with far fewer shared-memory loads than as the right operand
    (half the instructions per weight element; bench/README.md, the decode linear). Over this
    program's K slice, one absmax block of BS elements per iteration, so the block's scale is
    one value per row n:

        accT += round(code[q(n, blk)] · scale[n, blk]) @ x[:, blk]ᵀ     (bf16 dot, fp32 sums)
        t    += x[:, blk] @ A[:, blk]ᵀ                                   (the LoRA factor, fp32)

    then accT += s · B[n-block] @ tᵀ. The LoRA term is linear in t, so each K split adds its own
    s · t_split @ Bᵀ and the splits' sum is s · t @ Bᵀ: no separate launch for t. x's even and
    odd columns meet the high and low nibbles (two dots, never an interleave).

    The code lookup, PRMT (the GPU's): per row and block, the 16 values round(code[i] · scale)
    are formed once (fp32 products, as bitsandbytes forms them) and held in registers as byte
    planes; each nibble then selects its value by byte permutes, with no memory access per
    element. Otherwise (the interpreter's): one gather per nibble from the 16-entry fp32 code
    (one 64-byte line: a warp's gather is one L1 request), times the scale. Both give the same
    rounded weight bit for bit. PREFETCH issues the next block's loads (packed bytes, x and A
    columns, the scale) before this block's math, so their latency hides behind it; the scale
    is a gather indexed by a loaded byte (double quant), so its own loads go two blocks ahead.

    GLU (two segments of one N, gate then up, SPLIT): the output is y (M, N) = silu(gate) · up
    (`_silu_mul`). The gate tile and the up tile of the same columns share one arrival counter;
    the last of their 2 · SPLIT_K programs sums each one's partials and writes the product.

    PDL (`kernels.pdl`, launched before the previous kernel has completed): x is read only
    after `grid_wait`; each K loop's first weight loads (words or bytes and scale operands)
    come before it. EARLY_NEXT: the next kernel may start once every program has left its K
    loop (`_early_next`).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)  # the n-tile over all segments
    pid_k = tl.program_id(2)
    in1 = pid_n >= TILE_1
    in2 = pid_n >= TILE_2
    w_ptr = _seg(w_0, w_1, w_2, in1, in2, SEGS)
    code_ptr = _seg(code_0, code_1, code_2, in1, in2, SEGS)
    absmax_ptr = _seg(absmax_0, absmax_1, absmax_2, in1, in2, SEGS)
    code2_ptr = _seg(code2_0, code2_1, code2_2, in1, in2, SEGS)
    absmax2_ptr = _seg(absmax2_0, absmax2_1, absmax2_2, in1, in2, SEGS)
    offset_ptr = _seg(offset_0, offset_1, offset_2, in1, in2, SEGS)
    a_ptr = _seg(a_0, a_1, a_2, in1, in2, SEGS)
    b_ptr = _seg(b_0, b_1, b_2, in1, in2, SEGS)
    bias_ptr = _seg(bias_0, bias_1, bias_2, in1, in2, SEGS)
    N = _seg(N_0, N_1, N_2, in1, in2, SEGS)
    scaling = _seg(scaling_0, scaling_1, scaling_2, in1, in2, SEGS)
    tile0 = _seg(0, TILE_1, TILE_2, in1, in2, SEGS)  # the segment's first n-tile
    col0 = _seg(0, COL_1, COL_2, in1, in2, SEGS)  # and its first output column
    HB: tl.constexpr = BS // 2  # packed bytes per row per absmax block
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid_n - tile0) * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of the segment's W
    offs_j = tl.arange(0, HB)
    offs_k = tl.arange(0, BS)
    offs_r = tl.arange(0, BLOCK_R)
    m_ok = offs_m < M
    n_ok = offs_n < N
    r_ok = offs_r < R
    KB = K // BS  # absmax blocks per row
    n_blk = offs_n.to(tl.int64) * KB  # (BLOCK_N,) first absmax block of each row
    offset = tl.load(offset_ptr)  # the double-quant offset (a code entry, unused, otherwise)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # yᵀ of this tile
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if REG_TILE:  # BLOCK_N 64 on 4 warps, BLOCKS_PER_SPLIT counts steps of 256 columns
        acc, t = _reg_tile_loop(
            acc, t, w_ptr, code_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset, x_ptr, a_ptr,
            (pid_n - tile0) * BLOCK_N, N, K, offs_m, m_ok, offs_r, r_ok,
            pid_k * BLOCKS_PER_SPLIT,
            tl.minimum(pid_k * BLOCKS_PER_SPLIT + BLOCKS_PER_SPLIT, tl.cdiv(K, 256)),
            stride_xm, stride_ar, BS, BS2, NESTED, HAS_LORA, LORA_FP32, PRMT, PREFETCH,
            EVEN_K, PDL, INTERP)
    else:
        if not PREFETCH:
            grid_wait(PDL)
        blk_lo = pid_k * BLOCKS_PER_SPLIT
        blk_hi = tl.minimum(blk_lo + BLOCKS_PER_SPLIT, KB)
        if PREFETCH:  # block blk_lo's loads, and the scale operands of the block after it
            qa, a2 = _scale_operands(absmax_ptr, absmax2_ptr, n_blk + blk_lo, n_ok, BS2, NESTED)
            scale_next = _scale(qa, a2, code2_ptr, offset, NESTED)
            qa_next2, a2_next2 = _scale_operands(absmax_ptr, absmax2_ptr,
                                                 n_blk + tl.minimum(blk_lo + 1, blk_hi - 1), n_ok,
                                                 BS2, NESTED)
            p_next = _block_bytes(w_ptr, n_blk + blk_lo, offs_j, n_ok, HB, PRMT)
            grid_wait(PDL)  # the first block's weight loads before it (PDL), x after
            x_next, a_next = _x_and_a_block(x_ptr, a_ptr, offs_m, m_ok, offs_r, r_ok,
                                            blk_lo * BS + offs_k, stride_xm, stride_ar, HAS_LORA)
        for blk in range(blk_lo, blk_hi):
            if PREFETCH:
                # This block's loads were issued an iteration ago. Issue the next block's, and the
                # scale operands of the one after: the scale is a gather indexed by a loaded byte,
                # so its two loads are two iterations ahead and the L1 gather one.
                p, scale, x_blk, a_blk = p_next, scale_next, x_next, a_next
                nxt = tl.minimum(blk + 1, blk_hi - 1)
                p_next = _block_bytes(w_ptr, n_blk + nxt, offs_j, n_ok, HB, PRMT)
                x_next, a_next = _x_and_a_block(x_ptr, a_ptr, offs_m, m_ok, offs_r, r_ok,
                                                nxt * BS + offs_k, stride_xm, stride_ar, HAS_LORA)
                scale_next = _scale(qa_next2, a2_next2, code2_ptr, offset, NESTED)
                qa_next2, a2_next2 = _scale_operands(absmax_ptr, absmax2_ptr,
                                                     n_blk + tl.minimum(blk + 2, blk_hi - 1), n_ok,
                                                     BS2, NESTED)
            else:
                qa, a2 = _scale_operands(absmax_ptr, absmax2_ptr, n_blk + blk, n_ok, BS2, NESTED)
                scale = _scale(qa, a2, code2_ptr, offset, NESTED)
                p = _block_bytes(w_ptr, n_blk + blk, offs_j, n_ok, HB, PRMT)
                x_blk, a_blk = _x_and_a_block(x_ptr, a_ptr, offs_m, m_ok, offs_r, r_ok,
                                              blk * BS + offs_k, stride_xm, stride_ar, HAS_LORA)
            # code · scale in fp32, rounded to x's dtype: bitsandbytes' dequantized weight
            if PRMT:
                w_hi, w_lo = _dequant_prmt(p, scale, code_ptr, x_ptr.dtype.element_ty, BLOCK_N, HB)
            else:
                c_hi = tl.load(code_ptr + (p >> 4).to(tl.int32))
                c_lo = tl.load(code_ptr + (p & 15).to(tl.int32))
                w_hi = to_dtype(c_hi * scale[:, None], x_ptr.dtype.element_ty, INTERP)
                w_lo = to_dtype(c_lo * scale[:, None], x_ptr.dtype.element_ty, INTERP)
            # x's even and odd columns (split in registers) meet the high and low nibbles
            x_even, x_odd = tl.split(tl.reshape(x_blk, (BLOCK_M, HB, 2)))
            acc += dot(w_hi, tl.trans(x_even), INTERP)
            acc += dot(w_lo, tl.trans(x_odd), INTERP)
            if HAS_LORA:  # the whole block of x and A at once: t needs no even/odd split
                if LORA_FP32:  # A is not x's dtype: PEFT casts x to A's dtype; fp32 products
                    t += tl.dot(x_blk.to(tl.float32), tl.trans(a_blk.to(tl.float32)),
                                input_precision="ieee")
                else:  # 16-bit products are exact in fp32: the same t as an fp32 dot
                    t += dot(x_blk, tl.trans(a_blk), INTERP)
    let_next_launch(EARLY_NEXT)
    if HAS_LORA:
        b = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_r[None, :],
                    mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        acc += scaling * tl.dot(b.to(tl.float32), tl.trans(t), input_precision="ieee")
    mask = n_ok[:, None] & m_ok[None, :]
    cols = col0 + offs_n  # the output columns (of y and of the partials)
    part_offs = offs_m[None, :] * stride_pm + cols[:, None]
    if SPLIT:
        tl.store(part_ptr + pid_k * stride_ps + part_offs, acc, mask=mask)
        if LAST_REDUCES:
            # The tile's last split to arrive sums all splits' partials (`_sum_splits`, as the
            # separate reduction does) and resets the tile's counter to zero for the next call.
            # Every thread's partial is stored before the counter's release; the last program
            # reads the others' partials after its acquire.
            tl.debug_barrier()
            splits = tl.num_programs(2)
            if GLU:  # the gate and up tiles of these columns: one counter, 2 · splits arrivals
                tile = pid_m * TILE_1 + pid_n - tile0
                arrivals = 2 * splits
            else:
                tile = pid_m * tl.num_programs(1) + pid_n
                arrivals = splits
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == arrivals - 1:
                if GLU:
                    gate_offs = offs_m[None, :] * stride_pm + offs_n[:, None]
                    g = _sum_splits(tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), part_ptr,
                                    gate_offs, mask, splits, stride_ps)
                    u = _sum_splits(tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), part_ptr,
                                    gate_offs + COL_1, mask, splits, stride_ps)
                    if HAS_BIAS:
                        g += tl.load(bias_0 + offs_n, mask=n_ok,
                                     other=0.0).to(tl.float32)[:, None]
                        u += tl.load(bias_1 + offs_n, mask=n_ok,
                                     other=0.0).to(tl.float32)[:, None]
                    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None],
                             _silu_mul(g, u, y_ptr.dtype.element_ty, INTERP), mask=mask)
                else:
                    acc = _sum_splits(tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), part_ptr,
                                      part_offs, mask, splits, stride_ps)
                    if HAS_BIAS:
                        acc += tl.load(bias_ptr + offs_n, mask=n_ok,
                                       other=0.0).to(tl.float32)[:, None]
                    tl.store(y_ptr + offs_m[None, :] * stride_ym + cols[:, None],
                             to_dtype(acc, y_ptr.dtype.element_ty, INTERP), mask=mask)
                tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + offs_m[None, :] * stride_ym + cols[:, None],
                 to_dtype(acc, y_ptr.dtype.element_ty, INTERP), mask=mask)


@dataclasses.dataclass(frozen=True)
class Packed4bit:
    """A bitsandbytes 4-bit weight as the kernel reads it (views of the module's storage)."""

    packed: torch.Tensor  # (N·K/2,) uint8
    code: torch.Tensor  # (16,) fp32
    absmax: torch.Tensor  # (N·K/BS,) fp32, or uint8 with double quant
    blocksize: int
    shape: tuple[int, int]  # (N, K)
    code2: torch.Tensor | None = None  # (256,) fp32, double quant only
    absmax2: torch.Tensor | None = None  # (N·K/BS/256,) fp32
    blocksize2: int = 256
    offset: torch.Tensor | None = None  # () fp32
    quant_type: str = "nf4"  # the code's name: "nf4" or "fp4"

    @classmethod
    def from_quant_state(cls, packed: torch.Tensor, qs) -> Packed4bit:
        """From a `Params4bit`'s data and its `quant_state`; ValueError for layouts we don't read."""
        if getattr(qs, "packing_format_for_cpu", False):
            raise ValueError("quant_state has packing_format_for_cpu=True (bitsandbytes' CPU "
                             "AVX512 repacking), not the standard 4-bit layout")
        if qs.quant_type not in ("nf4", "fp4"):
            raise ValueError(f"quant_state.quant_type={qs.quant_type!r}, expected nf4 or fp4")
        if len(qs.shape) != 2:
            raise ValueError(f"quant_state.shape={tuple(qs.shape)} is not 2-D")
        n, k = (int(d) for d in qs.shape)
        bs = int(qs.blocksize)
        if k % bs or bs % 2 or bs < 32:
            raise ValueError(f"in_features K={k} is not a multiple of blocksize={bs} (or bs < 32)")
        if qs.code is None or qs.code.numel() != 16:
            raise ValueError("quant_state.code is not a 16-entry 4-bit code table")
        packed = packed.reshape(-1)
        if packed.dtype != torch.uint8:
            packed = packed.view(torch.uint8)
        if packed.numel() != n * k // 2:
            raise ValueError(f"packed weight has {packed.numel()} bytes, expected N·K/2 = "
                             f"{n * k // 2} for shape {(n, k)}")
        common = {"packed": packed, "code": qs.code.float(), "blocksize": bs, "shape": (n, k),
                  "quant_type": qs.quant_type}
        if not qs.nested:
            return cls(absmax=qs.absmax.reshape(-1).float(), **common)
        s2 = qs.state2
        if qs.absmax.dtype != torch.uint8 or s2.code.numel() != 256:
            raise ValueError(f"double-quant absmax is {qs.absmax.dtype} with a "
                             f"{s2.code.numel()}-entry code, expected uint8 and 256")
        return cls(absmax=qs.absmax.reshape(-1), code2=s2.code.float(),
                   absmax2=s2.absmax.reshape(-1).float(), blocksize2=int(s2.blocksize),
                   offset=torch.as_tensor(qs.offset, dtype=torch.float32,
                                          device=packed.device).reshape(1), **common)

    @property
    def nested(self) -> bool:
        return self.code2 is not None


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


# the split-K grid's programs per SM (pick_config): at the Llama and Qwen layer shapes only the
# q/k/v launch depends on it between 2 and 3, and takes 3 (bench/README.md, the group sweep)
PROGRAMS_PER_SM = 3
# the fewest K steps a split program runs (`_split_rule`)
MIN_STEPS = 2
# the most rows the register tile takes (BLOCK_M 16, the smallest dot tile)
REG_TILE_ROWS = 16
# registers per thread of the register tile: 168 lets three programs of 4 warps share an SM
# (the compiler takes up to 255 otherwise: two); bench/README.md, the register tile's sweep
REG_TILE_MAXNREG = 168


def pick_config(m: int, n, k: int, blocksize: int, num_sms: int, glu: bool = False,
                reg_tile: bool = True) -> dict:
    """Tiles for M rows of x against weights of `n` output features (an int, or the sequence of
    a grouped call's N_s) and K input features.

    Up to 16 rows with a blocksize that is a multiple of 64: the register tile (REG_TILE,
    `_reg_tile_loop`), BLOCK_M 16 and BLOCK_N 64 on 4 warps, one step per 256 columns of K,
    at most REG_TILE_MAXNREG registers a thread, the loads of x and A pipelined 3 deep.
    Otherwise BLOCK_M covers the decode batch (16 is the smallest dot tile); BLOCK_N 64 output
    columns, 128 when the weights hold 2²⁵ elements or more, on 4 warps, one absmax block a
    step. Either way the K loop is split over programs so that the grid holds about
    PROGRAMS_PER_SM programs per SM (the largest power of two that does not pass it) and no
    program runs more than 32 absmax blocks (with the register tile, 16 steps of 256 columns,
    8 in a gate/up + silu · mul launch), but every program at least two blocks (steps); at
    most 32 splits.
    Each step's loads are issued one step ahead (PREFETCH), in registers (one pipeline stage
    outside the register tile).
    A gate/up + silu · mul launch (`glu`) writes its partials and sums them in a last program
    whatever its split, so the split is chosen by time alone: outside the register tile, at
    most 16 rows take BLOCK_N 64 and at least two splits; above, a program may run 64 steps,
    not 32. (bench/README.md, the decode linear: the rule against the sweep of every tile.)
    `reg_tile=False` gives the block-a-step rule at every M (the benchmark's comparison)."""
    ns = [n] if isinstance(n, int) else list(n)
    if reg_tile and m <= REG_TILE_ROWS and blocksize % 64 == 0:
        split = _split_rule(sum(triton.cdiv(v, 64) for v in ns), triton.cdiv(k, 256),
                            8 if glu else 16, num_sms)
        return {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": split, "num_warps": 4,
                "num_stages": 3, "PREFETCH": True, "REG_TILE": True,
                "maxnreg": REG_TILE_MAXNREG}
    small_glu = glu and m <= 16
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n = 128 if sum(ns) * k >= 1 << 25 and not small_glu else 64
    blocks = k // blocksize
    mn_progs = triton.cdiv(m, block_m) * sum(triton.cdiv(v, block_n) for v in ns)
    split = _split_rule(mn_progs, blocks, 64 if glu and not small_glu else 32, num_sms)
    if small_glu:
        split = max(split, min(2, blocks))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "SPLIT_K": split, "num_warps": 4,
            "num_stages": 1, "PREFETCH": True}


def _split_rule(programs: int, steps: int, max_steps: int, num_sms: int) -> int:
    """SPLIT_K for `programs` output tiles of `steps` K steps each: the largest power of two
    that keeps the grid within PROGRAMS_PER_SM programs per SM, raised to the power of two
    that keeps each program within `max_steps` steps, at most 32 and at most
    steps // MIN_STEPS (every program at least MIN_STEPS steps), at least 1."""
    by_sms = max(1, PROGRAMS_PER_SM * num_sms // programs)
    by_sms = 1 << (by_sms.bit_length() - 1)
    by_steps = triton.next_power_of_2(triton.cdiv(steps, max_steps))
    return max(1, min(max(by_sms, by_steps), 32, steps // MIN_STEPS))


def reg_tile_reason(cfg: dict, blocksize: int, parts) -> str | None:
    """Why the register tile cannot run this launch (None if it can): its layout is 64 rows on
    4 warps at BLOCK_M 16, a chunk of 64 elements must lie in one absmax block, and its word
    offsets are int32."""
    if (cfg["BLOCK_N"], cfg["BLOCK_M"], cfg.get("num_warps", 4)) != (64, 16, 4):
        return (f"BLOCK_N={cfg['BLOCK_N']}, BLOCK_M={cfg['BLOCK_M']}, "
                f"num_warps={cfg.get('num_warps', 4)} (it takes 64, 16, 4)")
    if blocksize % 64:
        return f"blocksize {blocksize} is not a multiple of 64"
    if any(p.weight.packed.numel() >= 1 << 31 for p in parts):
        return "a packed weight of 2³¹ bytes or more"
    return None


def split_steps(blocks: int, split: int) -> tuple[int, int]:
    """(absmax blocks per program, programs along K) for `split` programs asked over `blocks`
    blocks: every program gets the same number of steps but the last, and none gets none."""
    per = triton.cdiv(blocks, split)
    return per, triton.cdiv(blocks, per)


@dataclasses.dataclass(frozen=True)
class LinearPart:
    """One projection of a grouped call: y_s = x @ round(W)ᵀ + bias + scaling · (x @ Aᵀ) @ Bᵀ."""

    weight: Packed4bit
    bias: torch.Tensor | None = None
    lora_a: torch.Tensor | None = None  # (r, K)
    lora_b: torch.Tensor | None = None  # (N, r)
    scaling: float = 1.0


MAX_GROUP = 3  # projections one launch computes (q, k, v)


def _check_part(x: torch.Tensor, part: LinearPart, name: str) -> LinearPart:
    """`part` with contiguous LoRA factors; ValueError naming the argument for shapes that do not
    fit x (M, K)."""
    n, k = part.weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected (M, {k}) for weight {(n, k)}")
    if (part.lora_a is None) != (part.lora_b is None):
        raise ValueError(f"{name}lora_a and {name}lora_b come together")
    if part.lora_a is not None:
        r = part.lora_a.shape[0]
        if part.lora_a.shape != (r, k) or part.lora_b.shape != (n, r):
            raise ValueError(f"{name}lora_a {tuple(part.lora_a.shape)} and {name}lora_b "
                             f"{tuple(part.lora_b.shape)} do not fit (r, K={k}) and (N={n}, r)")
        part = dataclasses.replace(part, lora_a=part.lora_a.contiguous(),
                                   lora_b=part.lora_b.contiguous())
    if part.bias is not None and part.bias.shape != (n,):
        raise ValueError(f"{name}bias has shape {tuple(part.bias.shape)}, expected ({n},)")
    return part


def group_reason(parts: list[LinearPart]) -> str | None:
    """Why `parts` cannot share one launch (None if they can): at most MAX_GROUP, the same
    in_features, blocksizes and double quant, LoRA on all or none with one rank and dtypes, a
    bias on all or none in one dtype."""
    if not 1 <= len(parts) <= MAX_GROUP:
        return f"{len(parts)} projections (one launch takes 1 to {MAX_GROUP})"
    first = parts[0]

    def sig(p: LinearPart):
        w = p.weight
        return (w.shape[1], w.blocksize, w.nested, w.blocksize2 if w.nested else None,
                None if p.lora_a is None else (p.lora_a.shape[0], p.lora_a.dtype, p.lora_b.dtype),
                None if p.bias is None else p.bias.dtype)

    names = ("in_features", "blocksize", "double quant", "second-level blocksize",
             "LoRA (rank, A dtype, B dtype)", "bias dtype")
    for p in parts[1:]:
        for name, u, v in zip(names, sig(first), sig(p)):
            if u != v:
                return f"the projections differ in {name} ({u} vs {v})"
    return None


def _checked(x: torch.Tensor, parts: list[LinearPart]) -> tuple[torch.Tensor, list]:
    """x with unit column stride and the checked parts; ValueError naming the argument."""
    if x.dim() != 2:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected (M, K)")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x has dtype {x.dtype}, expected bfloat16 or float16")
    reason = group_reason(parts)
    if reason is not None:
        raise ValueError(f"parts: {reason}")
    many = len(parts) > 1
    parts = [_check_part(x, p, f"parts[{i}]." if many else "") for i, p in enumerate(parts)]
    return (x if x.stride(1) == 1 else x.contiguous()), parts


def linear4bit_lora_group(x: torch.Tensor, parts: list[LinearPart], *,
                          config: dict | None = None, defer_sum: bool = False,
                          lora_t: LoraT | None = None) -> list:
    """[y_s (M, N_s)] for each part, in one launch (`group_reason` says which parts can share
    it): y_s = x @ round(W_s)ᵀ + bias_s + scaling_s · (x @ A_sᵀ) @ B_sᵀ, each exactly as
    `linear4bit_lora` computes it alone. The outputs are column slices of one (M, Σ N_s)
    buffer. `defer_sum`: where the launch splits K, each y_s is returned as a
    `split_sum.SplitSum` (its partials, not yet summed; the same bits once summed) for a kernel
    that takes one (`add_rmsnorm`, `rope_cache_write`). `lora_t`: LoRA's t of this x and the
    parts' factors as `add_rmsnorm` formed it (`lora_t.LoraT`), which the warp-specialized
    kernel sums instead of forming it again (the register tile forms its own: the same t up to
    the order of fp32 sums)."""
    x, parts = _checked(x, parts)
    return _launch(x, parts, config, glu=False, defer_sum=defer_sum, lora_t=lora_t)


def linear4bit_lora_silu_mul(x: torch.Tensor, gate: LinearPart, up: LinearPart, *,
                             config: dict | None = None,
                             lora_t: LoraT | None = None) -> torch.Tensor:
    """silu(y_gate) · y_up (M, N) in one launch, y_gate and y_up each as
    `linear4bit_lora_group(x, [gate, up])` gives them (rounded to x's dtype), then torch's
    `F.silu(y_gate) * y_up` on them (`_silu_mul`; bit for bit on the GPU, whose expf is
    libdevice's as torch's is). Neither projection's output is written to memory. `lora_t`:
    as `linear4bit_lora_group`'s."""
    if gate.weight.shape[0] != up.weight.shape[0]:
        raise ValueError(f"gate has {gate.weight.shape[0]} output features and up "
                         f"{up.weight.shape[0]}: silu(gate) · up needs the same number")
    x, parts = _checked(x, [gate, up])
    return _launch(x, parts, config, glu=True, lora_t=lora_t)[0]


def _launch(x: torch.Tensor, parts: list[LinearPart], config: dict | None,
            glu: bool, defer_sum: bool = False, lora_t: LoraT | None = None) -> list:
    """The kernel over checked parts: [y_s] (`linear4bit_lora_group`), or with `glu` (two
    parts of one N) [silu(y_0) · y_1]. `defer_sum`: where the launch splits K (and not
    `glu`), [SplitSum_s]: the programs store their partials and the consumer sums them."""
    if lora_t is not None:  # a t of other operands would add a wrong term: refused
        lora_t.check(x, [p.lora_a for p in parts])
    if linear4bit_ws.reason(x, parts, glu, config) is None:  # Hopper, a few rows
        ys = linear4bit_ws.launch(x, parts, glu, defer_sum, lora_t)
        if ys is not None:
            return ys
    m, k = x.shape
    ns = [p.weight.shape[0] for p in parts]
    first = parts[0]
    has_lora, has_bias = first.lora_a is not None, first.bias is not None
    r = first.lora_a.shape[0] if has_lora else 0
    bs = first.weight.blocksize
    cfg = config or pick_config(m, ns, k, bs, _num_sms(x.device), glu=glu)
    interp = interpreting()
    # the permute lookup reads each row's bytes of a block as 32-bit words: 4-byte aligned
    # (allocations are; a view at an odd offset takes the gathers, the same values)
    words = bs % 8 == 0 and all(p.weight.packed.data_ptr() % 4 == 0 for p in parts)
    prmt = cfg.get("PRMT", not interp and words)
    if prmt and interp:
        raise ValueError("config PRMT=True (the code looked up by PTX byte permutes) needs the "
                         "GPU compiler; Triton's interpreter runs PRMT=False")
    if prmt and not words:
        raise ValueError("config PRMT=True reads the packed weight as 4-byte words: it needs a "
                         "blocksize multiple of 8 and a 4-byte-aligned packed weight")
    reason = reg_tile_reason(cfg, bs, parts)
    reg_tile = cfg.get("REG_TILE", reason is None)
    if reg_tile and reason is not None:
        raise ValueError(f"config REG_TILE=True cannot run here: {reason}")
    per, split_k = split_steps(triton.cdiv(k, 256) if reg_tile else k // bs, cfg["SPLIT_K"])
    split = split_k > 1 or glu  # partials in fp32, summed by a tile's last program
    defer_sum = defer_sum and split and not glu  # ... or by the kernel that reads y next
    bn = cfg["BLOCK_N"]
    tiles = [triton.cdiv(n, bn) for n in ns]
    cols = [sum(ns[:i]) for i in range(len(ns))]
    y = torch.empty(m, ns[0] if glu else sum(ns), device=x.device, dtype=x.dtype)
    part_buf = (torch.empty(split_k, m, sum(ns), device=x.device, dtype=torch.float32)
                if split else y)  # (SPLIT_K, M, Σ N_s)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), sum(tiles), split_k)
    counters = grid[0] * (tiles[0] if glu else grid[1])  # a GLU pair of tiles shares one
    counts = (arrival_counters(x.device, counters)
              if split and not defer_sum and cfg.get("LAST_REDUCES", True) else None)
    seg_args, seg_ns, seg_scalings = [], [], []
    for i in range(MAX_GROUP):
        p = parts[min(i, len(parts) - 1)]  # absent segments repeat the last (never selected)
        w = p.weight
        seg_args += [w.packed, w.code, w.absmax, w.code2 if w.nested else w.code,
                     w.absmax2 if w.nested else w.code, w.offset if w.nested else w.code,
                     p.lora_a if has_lora else x, p.lora_b if has_lora else x,  # placeholders
                     p.bias if has_bias else y]  # never read without LoRA / bias
        seg_ns.append(w.shape[0])
        seg_scalings.append(float(p.scaling))
    first_tile = [sum(tiles[:i]) for i in range(1, MAX_GROUP)]
    beyond = grid[1]  # a first tile no program reaches: the segment is absent
    first_tile = [t if i + 1 < len(parts) else beyond for i, t in enumerate(first_tile)]
    first_col = [cols[i] if i < len(parts) else 0 for i in range(1, MAX_GROUP)]
    pdl_args = launch_args(_linear4bit_lora_kernel, x.device)
    _linear4bit_lora_kernel[grid](
        x, y, part_buf, counts if counts is not None else y,
        *seg_args, *seg_ns, *seg_scalings, *first_tile, *first_col,
        m, k, r, per,
        x.stride(0), first.lora_a.stride(0) if has_lora else 0,
        first.lora_b.stride(0) if has_lora else 0, y.stride(0),
        part_buf.stride(0) if split else 0, part_buf.stride(1) if split else 0,
        SEGS=len(parts), BS=bs, BS2=first.weight.blocksize2, NESTED=first.weight.nested,
        HAS_LORA=has_lora, LORA_FP32=has_lora and first.lora_a.dtype != x.dtype,
        HAS_BIAS=has_bias, SPLIT=split, LAST_REDUCES=counts is not None,
        GLU=glu and counts is not None,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bn, BLOCK_R=max(16, triton.next_power_of_2(r)),
        PRMT=prmt, PREFETCH=cfg.get("PREFETCH", False), REG_TILE=reg_tile,
        EVEN_K=reg_tile and k % 256 == 0, INTERP=interp,
        **pdl_args, EARLY_NEXT=_early_next(pdl_args["PDL"], reg_tile, grid, x.device),
        # no FMA contraction: the double-quant scale code2·absmax2 + offset is then formed with
        # the same two roundings as bitsandbytes' (a product, then an add)
        enable_fp_fusion=False, num_warps=cfg.get("num_warps", 4),
        # the gathers' form of the register tile pipelines (64, 128) tiles of bytes and scales:
        # past one stage they do not fit shared memory
        num_stages=1 if reg_tile and not prmt else cfg.get("num_stages", 1),
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )
    if defer_sum:
        return [SplitSum(part_buf[:, :, c:c + n], p.bias, x.dtype, n)
                for c, n, p in zip(cols, ns, parts)]
    if glu and counts is not None:
        return [y]
    out = torch.empty(m, sum(ns), device=x.device, dtype=x.dtype) if glu else y
    outs = [out[:, c:c + n] for c, n in zip(cols, ns)]
    if split and counts is None:
        bm, rbn = cfg["BLOCK_M"], 64
        for c, n, p, o in zip(cols, ns, parts, outs):
            seg_part = part_buf[:, :, c:c + n]
            _split_k_reduce_kernel[(triton.cdiv(m, bm), triton.cdiv(n, rbn))](
                seg_part, p.bias if has_bias else y, o, m, n, split_k, seg_part.stride(0),
                seg_part.stride(1), o.stride(0), HAS_BIAS=has_bias, BLOCK_M=bm,
                BLOCK_N=rbn, INTERP=interp)
    if glu:  # no counters (first capture): the same function by torch's ops
        return [torch.nn.functional.silu(outs[0]) * outs[1]]
    return outs


def _early_next(launched_pdl: bool, reg_tile: bool, grid: tuple, device: torch.device) -> bool:
    """Whether a launch lets the next kernel start after its K loop (`pdl.let_next_launch`):
    launched with PDL (`pdl.launch_args`), on the register tile, when all its programs run at
    once (at most PROGRAMS_PER_SM a SM; `pdl.EARLY_NEXT_WAVES` such rounds)."""
    early = (launched_pdl and reg_tile and grid[0] * grid[1] * grid[2]
             <= pdl.EARLY_NEXT_WAVES * PROGRAMS_PER_SM * _num_sms(device))
    if early:
        pdl.LAUNCHES["_linear4bit_lora_kernel early next"] += 1
    return early


def linear4bit_lora(x: torch.Tensor, w: Packed4bit, *, bias: torch.Tensor | None = None,
                    lora_a: torch.Tensor | None = None, lora_b: torch.Tensor | None = None,
                    scaling: float = 1.0, config: dict | None = None) -> torch.Tensor:
    """y (M, N) in x's dtype = x @ round(W)ᵀ + bias + scaling · (x @ lora_aᵀ) @ lora_bᵀ
    (module docstring for the bound). x (M, K) bf16/fp16; lora_a (r, K), lora_b (N, r) any
    float dtype, read at this call. `config`: BLOCK_M, BLOCK_N, SPLIT_K and optionally
    num_warps, num_stages (default `pick_config`), PRMT (default: on the GPU; the code table
    looked up by register byte permutes, else by memory gathers, the same values), PREFETCH,
    LAST_REDUCES (default True: with split K, each tile's last split sums the partials in the
    same launch; False: a second launch does), REG_TILE (default: where `reg_tile_reason`
    allows; the weight tile formed in the MMA's register layout, SPLIT_K then splits steps of
    256 columns), maxnreg (a cap on registers per thread, for more
    programs per SM; default none)."""
    return linear4bit_lora_group(x, [LinearPart(w, bias, lora_a, lora_b, scaling)],
                                 config=config)[0]


class UnsupportedLinear(ValueError):
    """The module has no decode path here; the message says why (the caller falls back to the
    module's own forward and logs this message once)."""


@dataclasses.dataclass(frozen=True)
class _Resolved:
    base: torch.nn.Module  # bnb.nn.Linear4bit or nn.Linear
    lora_a: torch.Tensor | None  # (r, K), the adapter's live Parameter
    lora_b: torch.Tensor | None  # (N, r)
    scaling: float


def _resolve_lora(module: torch.nn.Module) -> _Resolved:
    """The base layer and the one active LoRA adapter of a PEFT LoRA layer (or the module itself
    when it is no PEFT layer). Raises UnsupportedLinear for what the fused path does not compute
    as PEFT does."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no PEFT installed: no PEFT layers either
        LoraLayer = ()
    if not isinstance(module, LoraLayer):
        return _Resolved(module, None, None, 0.0)
    name = type(module).__name__
    base = module.get_base_layer()
    if module.disable_adapters or module.merged:
        # the base layer alone is the forward (a merged adapter lives in the base weight)
        return _Resolved(base, None, None, 0.0)
    if getattr(module, "fan_in_fan_out", False):
        raise UnsupportedLinear(f"{name} has fan_in_fan_out=True (Conv1D weight layout)")
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) > 1:
        raise UnsupportedLinear(f"{name} has {len(active)} active adapters {active}; the fused "
                                "path takes one")
    if not active:
        return _Resolved(base, None, None, 0.0)
    (a,) = active
    if a in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(a):
        raise UnsupportedLinear(f"{name} adapter {a!r} is a LoRA variant (DoRA or other)")
    if module.lora_B[a].bias is not None:
        raise UnsupportedLinear(f"{name} adapter {a!r} has a lora_B bias (lora_bias=True)")
    drop = module.lora_dropout[a]
    if drop.training and getattr(drop, "p", 0.0) > 0:
        raise UnsupportedLinear(f"{name} adapter {a!r} has dropout p={drop.p} in train mode "
                                "(the fused path computes eval mode, dropout = identity)")
    return _Resolved(base, module.lora_A[a].weight, module.lora_B[a].weight,
                     float(module.scaling[a]))


def _is_linear4bit(base: torch.nn.Module) -> bool:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return isinstance(base, bnb.nn.Linear4bit)


def lora_factors(modules) -> tuple | None:
    """The live LoRA factors A (r, K) of `modules`, in order (for `add_rmsnorm`'s lora_a), or
    None where one of them has no active adapter."""
    a = tuple(_resolve_lora(m).lora_a for m in modules)
    return None if any(aj is None for aj in a) else a


def unsupported_reason(module: torch.nn.Module) -> str | None:
    """None if `decode_linear(x, module)` computes this module's forward, else why not."""
    try:
        res = _resolve_lora(module)
        if _is_linear4bit(res.base):
            _packed_weight(res.base)
        elif type(res.base) is not torch.nn.Linear:
            raise UnsupportedLinear(f"base layer is {type(res.base).__name__}, expected "
                                    "bitsandbytes Linear4bit or torch.nn.Linear")
    except UnsupportedLinear as e:
        return str(e)
    return None


def _packed_weight(base: torch.nn.Module) -> Packed4bit:
    qs = getattr(base.weight, "quant_state", None)
    if qs is None:
        raise UnsupportedLinear("Linear4bit weight is not quantized yet (no quant_state: "
                                "the module was never moved to its device)")
    try:
        return Packed4bit.from_quant_state(base.weight.data, qs)
    except ValueError as e:
        raise UnsupportedLinear(f"Linear4bit weight: {e}") from None


def _fused_part(res: _Resolved, x_dtype: torch.dtype,
                device: torch.device) -> tuple[LinearPart, torch.dtype]:
    """(the kernel's view of a resolved 4-bit module for x of x_dtype, its compute dtype: the
    module's, else x's); UnsupportedLinear if the base is no bitsandbytes Linear4bit the kernel
    reads."""
    base = res.base
    if not _is_linear4bit(base):
        raise UnsupportedLinear(f"base layer is {type(base).__name__}, not bitsandbytes "
                                "Linear4bit")
    w = _packed_weight(base)
    cd = base.compute_dtype or x_dtype
    if cd not in (torch.bfloat16, torch.float16):
        raise UnsupportedLinear(f"Linear4bit compute dtype is {cd}, the kernel takes "
                                "bfloat16 or float16")
    if base.weight.device != device:
        raise ValueError(f"x is on {device} but the weight is on {base.weight.device}")
    bias = None if base.bias is None else base.bias.to(cd)
    return LinearPart(w, bias, res.lora_a, res.lora_b, res.scaling), cd


def _group_parts(modules, x_dtype: torch.dtype,
                 device: torch.device) -> tuple[list[LinearPart], torch.dtype]:
    """The kernel's parts for `modules`, one launch's worth; UnsupportedLinear with the reason
    if they cannot share it."""
    parts = [_fused_part(_resolve_lora(mod), x_dtype, device) for mod in modules]
    if len({cd for _, cd in parts}) > 1:
        raise UnsupportedLinear("the projections differ in compute dtype")
    reason = group_reason([p for p, _ in parts])
    if reason is not None:
        raise UnsupportedLinear(reason)
    return [p for p, _ in parts], parts[0][1]


def group_modules_reason(modules, x_dtype: torch.dtype) -> str | None:
    """Why `decode_linears(x, modules)` cannot compute `modules` (projections of one input of
    x_dtype, on their weights' device) in one launch, or None."""
    try:
        _group_parts(modules, x_dtype, _resolve_lora(modules[0]).base.weight.device)
    except ValueError as e:  # UnsupportedLinear included
        return str(e)
    return None


def decode_linears(x: torch.Tensor, modules, *, defer_sum: bool = False,
                   lora_t: LoraT | None = None) -> list:
    """[module(x) for module in modules] in one launch of the fused kernel, for 4-bit
    projections of the same input (q/k/v, gate/up) that `group_modules_reason` accepts; each
    output within the kernel's bound of module(x) (the group's tiles may split K otherwise
    than `decode_linear(x, module)` alone). Raises UnsupportedLinear (a ValueError) with the
    reason otherwise. `defer_sum`: as `decode_linear`'s. `lora_t`: as
    `linear4bit_lora_group`'s (from `add_rmsnorm(..., lora_a=lora_factors(modules))`)."""
    parts, cd = _group_parts(modules, x.dtype, x.device)
    ys = linear4bit_lora_group(x.reshape(-1, x.shape[-1]).to(cd), parts,
                               defer_sum=defer_sum and cd == x.dtype, lora_t=lora_t)
    return [_output(y, x) for y in ys]


def _output(y, x: torch.Tensor):
    """A projection's (M, N) output (or SplitSum) in x's dtype and leading shape."""
    if isinstance(y, SplitSum):
        return y.view(*x.shape[:-1], y.n)
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[1])


def _silu_mul_parts(gate, up, x_dtype: torch.dtype,
                    device: torch.device) -> tuple[LinearPart, LinearPart]:
    """The kernel's gate and up parts; UnsupportedLinear with the reason where one launch
    cannot form silu(gate(x)) · up(x) as the modules do."""
    (g, u), cd = _group_parts((gate, up), x_dtype, device)
    if cd != x_dtype:  # the modules' silu · mul would act on outputs cast back to x_dtype
        raise UnsupportedLinear(f"compute dtype {cd} is not the input's {x_dtype}")
    if g.weight.shape[0] != u.weight.shape[0]:
        raise UnsupportedLinear(f"gate has {g.weight.shape[0]} output features and up "
                                f"{u.weight.shape[0]}")
    return g, u


def silu_mul_modules_reason(gate, up, x_dtype: torch.dtype) -> str | None:
    """Why `decode_silu_mul(x, gate, up)` cannot compute silu(gate(x)) · up(x) for x of
    x_dtype (on the weights' device) in one launch of the fused kernel, or None."""
    try:
        _silu_mul_parts(gate, up, x_dtype, _resolve_lora(gate).base.weight.device)
    except ValueError as e:  # UnsupportedLinear included
        return str(e)
    return None


def decode_silu_mul(x: torch.Tensor, gate: torch.nn.Module, up: torch.nn.Module, *,
                    lora_t: LoraT | None = None) -> torch.Tensor:
    """F.silu(gate(x)) * up(x) in one launch (`linear4bit_lora_silu_mul`) for the 4-bit
    projections `silu_mul_modules_reason` accepts; each projection within the kernel's bound of
    its module, and the silu · mul torch's on them. Raises UnsupportedLinear (a ValueError)
    with the reason otherwise. `lora_t`: as `decode_linears`'."""
    g, u = _silu_mul_parts(gate, up, x.dtype, x.device)
    h = linear4bit_lora_silu_mul(x.reshape(-1, x.shape[-1]), g, u, lora_t=lora_t)
    return h.reshape(*x.shape[:-1], h.shape[1])


def decode_linear(x: torch.Tensor, module: torch.nn.Module, *,
                  defer_sum: bool = False) -> torch.Tensor | SplitSum:
    """module(x) for x (..., K), in eval-mode semantics, through the fused 4-bit + LoRA kernel:

    - bitsandbytes `Linear4bit` (x cast to its compute_dtype, the result back to x's dtype),
    - PEFT `lora.Linear4bit` / `lora.Linear` with one active adapter (dropout is the identity:
      eval mode, or p = 0), scaling read from the layer,
    - torch.nn.Linear (+ LoRA): cuBLAS GEMMs in PEFT's order, no kernel of ours.

    Reads every weight, LoRA factor and scale from the module's storage at this call. No
    autograd (the output has no grad_fn): this is the sampler's forward.
    Raises UnsupportedLinear (a ValueError) with the reason for anything else.
    `defer_sum`: where the fused kernel splits K and computes in x's dtype, the output is a
    `split_sum.SplitSum` (the splits' partials, for `add_rmsnorm` or `rope_cache_write` to sum:
    the same bits as the tensor); a tensor otherwise.
    """
    res = _resolve_lora(module)
    base = res.base
    if _is_linear4bit(base):
        part, cd = _fused_part(res, x.dtype, x.device)
        (y,) = linear4bit_lora_group(x.reshape(-1, x.shape[-1]).to(cd), [part],
                                     defer_sum=defer_sum and cd == x.dtype)  # (M, N)
        return _output(y, x)
    if type(base) is not torch.nn.Linear:
        raise UnsupportedLinear(f"base layer is {type(base).__name__}, expected bitsandbytes "
                                "Linear4bit or torch.nn.Linear")
    y = torch.nn.functional.linear(x, base.weight, base.bias)
    if res.lora_a is None:
        return y
    xa = x.to(res.lora_a.dtype)
    lora = torch.nn.functional.linear(torch.nn.functional.linear(xa, res.lora_a), res.lora_b)
    return (y + lora * res.scaling).to(y.dtype)  # PEFT's lora.Linear order and roundings
