"""Lab: the warp-specialized decode linear with the weight as the MMA's B operand (8 consumer
warps, each 8 weight rows), against the product kernel (`linear4bit_ws`, 4 warps of 16 rows).

Why (bench/README.md, session 30): the product kernel's consumer is bound by latency with two
consumer warps a scheduler, not by its ALU operations, and its register need (about 150 a
thread) leaves no room for more warps at the two CTAs a SM its grids need. Here a warp takes 8
rows of the 64-row tile instead of 16: y_tileᵀ = x_pad @ round(W_tile)ᵀ with x (at most 8 rows,
padded to the MMA's 16 by registers known to be zero) as the A operand and the looked-up
weights as the B operand (k16 x n8), so a thread holds half the words, tables and operands, and
a CTA has 8 consumer warps.

With ρ a row of the stage and thread (warp w, lane l), Q = l % 4 (chunk Q: 64 columns, one
absmax block or part of one), a half step h (32 columns of each chunk):

    words  row ρ = 8·w + l // 4, words 8·Q + 4·h + j (j < 4)
    B_h    the (128, 64) right operand: row c = 32·j + 8·i + 2·Q + E is element E of byte i of
           word j, column ρ (`to_linear_layout(B_OP)`: lanes l % 4 are c's bits 1-2, l // 4 and
           the warp ρ's bits, registers c's bits 0 and 3-6)
    x_h    the (16, 128) left operand: column c is x[:, 256·step + 64·Q + 32·h + 8·j + 2·i + E],
           rows 8-15 zero (its register bit 1)

so, as in the product kernel, every conversion between the loaded registers and the operands
is asserted free at compile time. The table lookup is the product's (`linear4bit`'s PTX). The
LoRA factor t = A @ xᵀ is split over the 8 warps (warp w the columns 4·w .. 4·w + 3 of each
half of each chunk: a batched MMA) and summed after the loop. Scope: one projection or a
gate/up + silu · mul pair (the product's GLU scheme and roundings), M <= 8, no bias, rank-16
bf16 LoRA or none, split K into fp32 partials (summed by a second launch, or handed on as a
SplitSum); no grouped q/k/v, no PDL. `launch` has `linear4bit_ws._launch`'s contract, so
`bench.decode_loop`'s variant `loop_ws_lab_b` can put o, down and gate/up on it.

    python3 -m bench.lab_gluon_linear --lora --models 8b,1b --rows 8 --splits 1,2,4 \
        --variants ";LAB_B=1"          # the product kernel and this one, in one process
    python3 -m bench.lab_gluon_linear --check --variants "LAB_B=1"
    python3 -m bench.decode_loop --bases nf4 --batches 8 --variants loop,loop_ws_no_pdl,loop_ws_lab_b \
        --kernels auto --new 256 --reps 3          # and --model 8b

`python -m bench.lab_gluon_linear_b [maxnreg]` compiles it for sm_90 on any machine (no GPU)
and prints its shared memory, the warp groups' registers, spills and SASS mix; every layout
conversion above passes its `assert_trivial` there. Measured on an H100 (bench/README.md,
session 31): exact (`--check`, worst 0.73 of the bound), and not faster than the product
kernel (8B gate/up 26.6 against 24.6 µs): twice the consumer warps a scheduler, and 27 % more
instructions (the x operand's zero-padding register moves) that spend the latency cover again.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from trainers.sampling.kernels import _linear4bit_ws_kernel as P
from trainers.sampling.kernels import linear4bit_ws as WS

ROWS = gl.constexpr(64)
STEP_WORDS = gl.constexpr(32)
RANK = gl.constexpr(16)
WARPS = 8
MAXNREG = 80  # at launch: 12 warps (8 consumers, the producer's warp group) x 2 CTAs a SM

# the stage's words as the consumer holds them (module docstring)
WORDS2 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4]],
    lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[8, 0], [16, 0], [32, 0]], block_bases=[], shape=[64, 32]))
WORDS3 = gl.constexpr(gl.BlockedLayout([1, 1, 8], [8, 4, 1], [8, 1, 1], [2, 1, 0]))
HALF = gl.constexpr(gl.BlockedLayout([1, 1, 4], [8, 4, 1], [8, 1, 1], [2, 1, 0]))
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 8],
                                             instr_shape=[16, 8]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
# x padded to 16 rows: (pad, m, c), the pad A_OP's register bit 1 (its row bit 3)
X_PAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [1, 0, 0], [0, 0, 8], [0, 0, 16], [0, 0, 32], [0, 0, 64]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=[[0, 0, 0], [0, 0, 0], [0, 0, 0]], block_bases=[], shape=[2, 8, 128]))
# a stage's x (8 rows, chunk Q, 64 columns), every warp all of it
XLOAD = gl.constexpr(gl.BlockedLayout([1, 1, 64], [8, 4, 1], [1, 1, 8], [2, 1, 0]))
# t's warp split: warp w the columns 4w .. 4w + 3 of each half chunk; k of a warp's MMA is
# (E, Q, b, h) with column 32h + 4w + 2b + E
MMA3 = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[8, 1, 1],
                                              instr_shape=[1, 16, 8]))
A3_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA3, k_width=2))
B3_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA3, k_width=2))
A_SPLIT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [8, 0, 0], [0, 0, 2], [0, 0, 32]],
    lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[0, 0, 4], [0, 0, 8], [0, 0, 16]], block_bases=[], shape=[16, 4, 64]))
X_SPLIT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 32]],
    lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[0, 0, 4], [0, 0, 8], [0, 0, 16]], block_bases=[], shape=[8, 4, 64]))
# the epilogue: (8 m, 16 ranks, 64 n), the rank sum in a thread's registers
LORA3 = gl.constexpr(gl.BlockedLayout([2, 16, 1], [4, 1, 8], [1, 1, 8], [2, 1, 0]))


@gluon.jit
def _b_tile(w, t0, t1, t2, t3, t4, t5, t6, t7):
    """The (128, 64) B operand of a half step from its words w (64, 4, 4) [ρ, Q, j] and the
    chunk tables (64, 4, 1)."""
    b0, b1, b2, b3 = gl.inline_asm_elementwise(
        P.PAIRS, P.PAIRS_CONSTRAINTS, [w, t0, t1, t2, t3, t4, t5, t6, t7],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    v = gl.join(gl.join(P._halves(b0), P._halves(b1)), gl.join(P._halves(b2), P._halves(b3)))
    v = gl.reshape(v, [8, 8, 4, 4, 2, 2, 2])  # [w, r8, Q, j, E, i0, i1]
    v = gl.permute(v, (3, 6, 5, 2, 4, 0, 1))  # [j, i1, i0, Q, E, w, r8]
    return gl.convert_layout(gl.reshape(v, [128, 64]), B_OP, assert_trivial=True)


@gluon.jit
def _x_tile(xh):
    """The (16, 128) A operand from x's (8, 4, 32) [m, Q, e] columns 64·Q + 32·h + e, rows
    8-15 zero."""
    v = gl.reshape(xh, [8, 4, 4, 2, 2, 2])  # [m, Q, j, i1, i0, E]
    v = gl.permute(v, (0, 2, 3, 4, 1, 5))  # [m, j, i1, i0, Q, E]
    v = gl.convert_layout(gl.reshape(v, [8, 128]), gl.SliceLayout(0, X_PAD),
                          assert_trivial=True)
    pad = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, X_PAD)))[:, None, None]
    v = gl.where(pad == 0, gl.broadcast(v[None, :, :], pad)[0], 0.0)
    return gl.convert_layout(gl.reshape(v, [16, 128]), A_OP, assert_trivial=True)


@gluon.jit
def _x_tiles(xbuf):
    xv = xbuf.load(XLOAD)
    x_h0, x_h1 = gl.split(gl.permute(gl.reshape(xv, [8, 4, 2, 32]), (0, 1, 3, 2)))
    return _x_tile(x_h0), _x_tile(x_h1)


@gluon.jit
def _k_halves_b(b):
    """The (128, 64) B operand's rows c < 64 and c >= 64 (c's bit 6 a register bit)."""
    lo, hi = gl.split(gl.permute(gl.reshape(b, [2, 64, 64]), (1, 2, 0)))
    return (gl.convert_layout(lo, B_OP, assert_trivial=True),
            gl.convert_layout(hi, B_OP, assert_trivial=True))


@gluon.jit
def _k_halves_a(a):
    """The (16, 128) A operand's columns c < 64 and c >= 64."""
    lo, hi = gl.split(gl.permute(gl.reshape(a, [16, 2, 64]), (0, 2, 1)))
    return (gl.convert_layout(lo, A_OP, assert_trivial=True),
            gl.convert_layout(hi, A_OP, assert_trivial=True))


@gluon.jit
def _lora_t_step(abuf, xbuf, t8):
    """t8 (8, 16, 8) += the step's A @ xᵀ, warp w summing its column slices (MMA3)."""
    av = gl.reshape(abuf.load(A_SPLIT), [RANK, 4, 2, 8, 2, 2])  # [r, Q, h, w, b, E]
    av = gl.reshape(gl.permute(av, (3, 0, 2, 4, 1, 5)), [8, RANK, 32])  # [w, r, (h b Q E)]
    xv = gl.reshape(xbuf.load(X_SPLIT), [8, 4, 2, 8, 2, 2])  # [m, Q, h, w, b, E]
    xv = gl.reshape(gl.permute(xv, (3, 2, 4, 1, 5, 0)), [8, 32, 8])  # [w, (h b Q E), m]
    return mma_v2(gl.convert_layout(av, A3_OP, assert_trivial=True),
                  gl.convert_layout(xv, B3_OP, assert_trivial=True), t8)


@gluon.jit
def _step(bufs, xbufs, abufs, ready, empty, i, qa, a2, acc, acc1, acc2, acc3, t8, code2_ptr,
          offset, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15,
          BS: gl.constexpr, NESTED: gl.constexpr, STAGES: gl.constexpr,
          HAS_LORA: gl.constexpr):
    tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7 = P._table(
        _scale(qa, a2, code2_ptr, offset, BS, NESTED), c0, c1, c2, c3, c4, c5, c6, c7, c8,
        c9, c10, c11, c12, c13, c14, c15)
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    words = bufs.index(s).load(WORDS2)
    x0, x1 = _x_tiles(xbufs.index(s))
    if HAS_LORA:
        t8 = _lora_t_step(abufs.index(s), xbufs.index(s), t8)
    fence_async_shared()
    mbarrier.arrive(empty.index(s), count=1)
    w3 = gl.convert_layout(gl.reshape(words, [64, 4, 8]), WORDS3, assert_trivial=True)
    w_h0, w_h1 = gl.split(gl.permute(gl.reshape(w3, [64, 4, 2, 4]), (0, 1, 3, 2)))
    w_h0 = gl.convert_layout(w_h0, HALF, assert_trivial=True)
    w_h1 = gl.convert_layout(w_h1, HALF, assert_trivial=True)
    tb0 = tb0[:, :, None]
    tb1 = tb1[:, :, None]
    tb2 = tb2[:, :, None]
    tb3 = tb3[:, :, None]
    tb4 = tb4[:, :, None]
    tb5 = tb5[:, :, None]
    tb6 = tb6[:, :, None]
    tb7 = tb7[:, :, None]
    b0l, b0h = _k_halves_b(_b_tile(w_h0, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7))
    b1l, b1h = _k_halves_b(_b_tile(w_h1, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7))
    a0l, a0h = _k_halves_a(x0)
    a1l, a1h = _k_halves_a(x1)
    acc = mma_v2(a0l, b0l, acc)
    acc1 = mma_v2(a0h, b0h, acc1)
    acc2 = mma_v2(a1l, b1l, acc2)
    acc3 = mma_v2(a1h, b1h, acc3)
    return acc, acc1, acc2, acc3, t8


@gluon.jit
def _scale_operands(absmax_ptr, absmax2_ptr, row0, N, K, step, BS: gl.constexpr,
                    BS2: gl.constexpr, NESTED: gl.constexpr):
    """The product's `_scale_operands` in this kernel's HALF layout (one row and chunk a
    thread)."""
    rho = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, HALF)))
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, HALF)))
    row = row0 + rho[:, None]
    blk = row * (K // BS) + (step * 4 + q[None, :]) // (BS // 64)
    ok = (row < N) & (q[None, :] < 4)
    if NESTED:
        if BS == 64:
            qa = gl.load(absmax_ptr.to(gl.pointer_type(gl.int32)) + (row * (K // 256) + step)
                         + 0 * q[None, :], mask=ok, other=0)
        else:
            qa = gl.load(absmax_ptr + blk, mask=ok, other=0).to(gl.int32)
        return qa, gl.load(absmax2_ptr + blk // BS2, mask=ok, other=0.0)
    else:
        a = gl.load(absmax_ptr + blk, mask=ok, other=0.0)
        return a, a


@gluon.jit
def _scale(qa, a2, code2_ptr, offset, BS: gl.constexpr, NESTED: gl.constexpr):
    if NESTED:
        if BS == 64:
            q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, HALF)))
            qa = (qa >> (8 * q[None, :])) & 0xFF
        return gl.load(code2_ptr + qa) * a2 + offset
    else:
        return qa


@gluon.jit
def _k_loop(bufs, xbufs, abufs, ready, empty, code_ptr, absmax_ptr, absmax2_ptr, code2_ptr,
            offset_ptr, row0, N, K, step_lo, nsteps, i0, BS: gl.constexpr, BS2: gl.constexpr,
            NESTED: gl.constexpr, STAGES: gl.constexpr, HAS_LORA: gl.constexpr):
    """One projection's K loop over the ring's stages i0 .. i0 + nsteps - 1: (acc, t)."""
    t8 = gl.zeros([8, RANK, 8], gl.float32, MMA3)
    acc = gl.zeros([16, 64], gl.float32, MMA)
    acc1 = gl.zeros([16, 64], gl.float32, MMA)
    acc2 = gl.zeros([16, 64], gl.float32, MMA)
    acc3 = gl.zeros([16, 64], gl.float32, MMA)
    if NESTED:
        offset = gl.load(offset_ptr)
    else:
        offset = 0.0
    c0 = gl.load(code_ptr + 0)
    c1 = gl.load(code_ptr + 1)
    c2 = gl.load(code_ptr + 2)
    c3 = gl.load(code_ptr + 3)
    c4 = gl.load(code_ptr + 4)
    c5 = gl.load(code_ptr + 5)
    c6 = gl.load(code_ptr + 6)
    c7 = gl.load(code_ptr + 7)
    c8 = gl.load(code_ptr + 8)
    c9 = gl.load(code_ptr + 9)
    c10 = gl.load(code_ptr + 10)
    c11 = gl.load(code_ptr + 11)
    c12 = gl.load(code_ptr + 12)
    c13 = gl.load(code_ptr + 13)
    c14 = gl.load(code_ptr + 14)
    c15 = gl.load(code_ptr + 15)
    last = step_lo + nsteps - 1
    qa_next, a2_next = _scale_operands(absmax_ptr, absmax2_ptr, row0, N, K, step_lo, BS, BS2,
                                       NESTED)
    qa_next2, a2_next2 = _scale_operands(absmax_ptr, absmax2_ptr, row0, N, K,
                                         gl.minimum(step_lo + 1, last), BS, BS2, NESTED)
    for i in range(nsteps):
        step = step_lo + i
        qa, a2 = qa_next, a2_next
        qa_next, a2_next = qa_next2, a2_next2
        qa_next2, a2_next2 = _scale_operands(absmax_ptr, absmax2_ptr, row0, N, K,
                                             gl.minimum(step + 2, last), BS, BS2, NESTED)
        acc, acc1, acc2, acc3, t8 = _step(
            bufs, xbufs, abufs, ready, empty, i0 + i, qa, a2, acc, acc1, acc2, acc3, t8,
            code2_ptr,
            offset, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, BS,
            NESTED, STAGES, HAS_LORA)
    return (acc + acc1) + (acc2 + acc3), gl.sum(t8, axis=0)


@gluon.jit
def _consumer(bufs, xbufs, abufs, ready, empty, code_ptr, absmax_ptr, absmax2_ptr, code2_ptr,
              offset_ptr, code_ptr_u, absmax_ptr_u, absmax2_ptr_u, code2_ptr_u, offset_ptr_u,
              row0, N, K, step_lo, nsteps, BS: gl.constexpr, BS2: gl.constexpr,
              NESTED: gl.constexpr, STAGES: gl.constexpr, HAS_LORA: gl.constexpr,
              GLU: gl.constexpr):
    """(acc, t) of the projection; with GLU the up projection's after the gate's."""
    acc, t = _k_loop(bufs, xbufs, abufs, ready, empty, code_ptr, absmax_ptr, absmax2_ptr,
                     code2_ptr, offset_ptr, row0, N, K, step_lo, nsteps, 0, BS, BS2, NESTED,
                     STAGES, HAS_LORA)
    if GLU:
        acc_u, t_u = _k_loop(bufs, xbufs, abufs, ready, empty, code_ptr_u, absmax_ptr_u,
                             absmax2_ptr_u, code2_ptr_u, offset_ptr_u, row0, N, K, step_lo,
                             nsteps, nsteps, BS, BS2, NESTED, STAGES, HAS_LORA)
    else:
        acc_u, t_u = acc, t
    return acc, t, acc_u, t_u


@gluon.jit
def _producer(w_desc, x_desc, a_desc, w_desc_u, a_desc_u, bufs, xbufs, abufs, ready, empty,
              row0, step_lo, nsteps, STAGES: gl.constexpr, HAS_LORA: gl.constexpr,
              GLU: gl.constexpr):
    """The stages' copies: the projection's steps, then with GLU the up projection's."""
    nbytes: gl.constexpr = (w_desc.block_type.nbytes + x_desc.block_type.nbytes
                            + (a_desc.block_type.nbytes if HAS_LORA else 0))
    for i in range(nsteps * (2 if GLU else 1)):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        step = step_lo + i % nsteps
        if i < nsteps:
            P.tma_load(w_desc, [row0, step * STEP_WORDS], ready.index(s), bufs.index(s))
            if HAS_LORA:
                P.tma_load(a_desc, [0, step * 4, 0], ready.index(s), abufs.index(s))
        else:
            P.tma_load(w_desc_u, [row0, step * STEP_WORDS], ready.index(s), bufs.index(s))
            if HAS_LORA:
                P.tma_load(a_desc_u, [0, step * 4, 0], ready.index(s), abufs.index(s))
        P.tma_load(x_desc, [0, step * 4, 0], ready.index(s), xbufs.index(s))


@gluon.jit
def _rows8(acc):
    """The 8 real rows of acc (16, 64) [m_pad, n], in the epilogue's layout."""
    y8 = gl.split(gl.permute(gl.reshape(acc, [2, 8, 64]), (1, 2, 0)))[0]
    return gl.convert_layout(y8, gl.SliceLayout(1, LORA3))


@gluon.jit
def _lora_term(t, b_ptr, row0, N, stride_bn, scaling):
    """s · (B[tile] @ t)ᵀ (8 m, 64 n) fp32 in SliceLayout(1, LORA3), from t (16 ranks, 8 m)."""
    t3 = gl.convert_layout(gl.permute(t, (1, 0)), gl.SliceLayout(2, LORA3))  # (m, r)
    j = gl.arange(0, RANK, layout=gl.SliceLayout(1, gl.SliceLayout(0, LORA3)))
    n = row0 + gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(0, LORA3)))
    b = gl.load(b_ptr + n[None, :] * stride_bn + j[:, None],
                mask=(j < RANK)[:, None] & (n < N)[None, :], other=0.0).to(gl.float32)
    return gl.sum(t3[:, :, None] * b[None, :, :], axis=1) * scaling


@gluon.jit
def lab_b_kernel(w_desc, x_desc, a_desc, b_ptr, y_ptr, part_ptr, code_ptr, absmax_ptr,
                 absmax2_ptr, code2_ptr, offset_ptr, scaling, stride_bn,
                 w_desc_u, a_desc_u, b_ptr_u, code_ptr_u, absmax_ptr_u, absmax2_ptr_u,
                 code2_ptr_u, offset_ptr_u, scaling_u, stride_bn_u, N, K, M, stride_ym,
                 stride_ps, steps_per_split, BS: gl.constexpr, BS2: gl.constexpr,
                 NESTED: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
                 HAS_LORA: gl.constexpr, GLU: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """Grid (N / 64 tiles, K splits): y (M, N) bf16, or with SPLIT part[split] (M, N) fp32.
    GLU (one split): the arguments ending in _u are the up projection's, streamed after the
    gate's by the same CTA, and y = silu(gate) · up (the product's roundings)."""
    row0 = gl.program_id(0) * ROWS
    pid_k = gl.program_id(1)
    step_lo = pid_k * steps_per_split
    nsteps = gl.minimum(steps_per_split, K // 256 - step_lo)
    bufs = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, STEP_WORDS], w_desc.layout)
    xbufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 8, 4, 64], x_desc.layout)
    abufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES if HAS_LORA else 1, RANK, 4, 64],
                                      a_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    acc, t, acc_u, t_u = gl.warp_specialize([
        (_consumer, (bufs, xbufs, abufs, ready, empty, code_ptr, absmax_ptr, absmax2_ptr,
                     code2_ptr, offset_ptr, code_ptr_u, absmax_ptr_u, absmax2_ptr_u,
                     code2_ptr_u, offset_ptr_u, row0, N, K, step_lo, nsteps, BS, BS2, NESTED,
                     STAGES, HAS_LORA, GLU)),
        (_producer, (w_desc, x_desc, a_desc, w_desc_u, a_desc_u, bufs, xbufs, abufs, ready,
                     empty, row0, step_lo, nsteps, STAGES, HAS_LORA, GLU)),
    ], [1], [PRODUCER_REGS])
    y8 = _rows8(acc)
    if HAS_LORA:
        y8 += _lora_term(t, b_ptr, row0, N, stride_bn, scaling)
    m = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(1, LORA3)))
    n = row0 + gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, LORA3)))
    mask = (m < M)[:, None] & (n < N)[None, :]
    if GLU:
        u8 = _rows8(acc_u)
        if HAS_LORA:
            u8 += _lora_term(t_u, b_ptr_u, row0, N, stride_bn_u, scaling_u)
        gl.store(y_ptr + m[:, None] * stride_ym + n[None, :], P._silu_mul(y8, u8), mask=mask)
    elif SPLIT:
        gl.store(part_ptr + pid_k * stride_ps + m[:, None] * N + n[None, :], y8, mask=mask)
    else:
        gl.store(y_ptr + m[:, None] * stride_ym + n[None, :], y8.to(gl.bfloat16), mask=mask)


def launch(x: torch.Tensor, parts: list, glu: bool = False, defer_sum: bool = False,
           split: int | None = None) -> list:
    """`linear4bit_ws._launch`'s contract for one projection or a gate/up + silu · mul pair
    (no grouped q/k/v) by the lab kernel: [y], [SplitSum] where `defer_sum` and K is split, or
    with `glu` [silu(gate) · up]; `split` (default the product's split rule)."""
    from trainers.sampling.kernels.linear4bit import _num_sms, _split_k_reduce_kernel, split_steps
    from trainers.sampling.kernels.split_sum import SplitSum

    if len(parts) != (2 if glu else 1):
        raise ValueError(f"the lab kernel takes one projection or a gate/up pair, not "
                         f"{len(parts)} parts (glu={glu})")
    m, k = x.shape
    w = parts[0].weight
    n = w.shape[0]
    split = 1 if glu else split or WS.split_rule(n, k, _num_sms(x.device))
    per, split = split_steps(k // 256, split)
    x_desc = WS._descriptor(x, [m, k // 64, 64], [x.stride(0), 64, 1], [8, 4, 64], 16)
    first = WS._part_args(parts[0], x)[:10]
    up = WS._part_args(parts[1], x)[:10] if glu else first
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    partials = (torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1
                else y)
    lab_b_kernel[(triton.cdiv(n, 64), split)](
        first[0], x_desc, first[1], first[2], y, partials, *first[3:], *up, n, k, m,
        y.stride(0), partials.stride(0) if split > 1 else 0, per, BS=w.blocksize,
        BS2=w.blocksize2, NESTED=w.nested, SPLIT=split > 1, STAGES=WS.STAGES,
        HAS_LORA=parts[0].lora_a is not None, GLU=glu, PRODUCER_REGS=WS.PRODUCER_REGS,
        num_warps=WARPS, maxnreg=MAXNREG, enable_fp_fusion=False)
    if split == 1:
        return [y]
    if defer_sum:
        return [SplitSum(partials, None, x.dtype, n)]
    _split_k_reduce_kernel[(1, triton.cdiv(n, 64))](
        partials, y, y, m, n, split, partials.stride(0), partials.stride(1), y.stride(0),
        HAS_BIAS=False, BLOCK_M=16, BLOCK_N=64, INTERP=False)
    return [y]


def compile_check(maxnreg: int = MAXNREG) -> None:
    """Compile the lab kernel for sm_90 here (no GPU needed) and print its shared memory,
    spills and SASS mix."""
    import collections
    import os
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    fn = lab_b_kernel
    k = 4096
    w_desc = WS._descriptor(torch.zeros(256, k // 8, dtype=torch.int32), [256, k // 8],
                            [k // 8, 1], [64, 32], 32)
    a_desc = WS._descriptor(torch.zeros(16, k, dtype=torch.bfloat16), [16, k // 64, 64],
                            [k, 64, 1], [16, 4, 64], 16)
    x_desc = WS._descriptor(torch.zeros(8, k, dtype=torch.bfloat16), [8, k // 64, 64],
                            [k, 64, 1], [8, 4, 64], 16)
    descs = {"w_desc": w_desc, "a_desc": a_desc, "x_desc": x_desc, "w_desc_u": w_desc,
             "a_desc_u": a_desc}
    for lora, glu in ((True, False), (False, False), (True, True)):
        consts = {"BS": 64, "BS2": 256, "NESTED": True, "SPLIT": not glu, "STAGES": WS.STAGES,
                  "HAS_LORA": lora, "GLU": glu, "PRODUCER_REGS": WS.PRODUCER_REGS}
        types = {"y_ptr": "*bf16", "part_ptr": "*fp32"}
        for u in ("", "_u"):
            types.update({f"b_ptr{u}": "*bf16", f"code_ptr{u}": "*fp32",
                          f"absmax_ptr{u}": "*u8", f"absmax2_ptr{u}": "*fp32",
                          f"code2_ptr{u}": "*fp32", f"offset_ptr{u}": "*fp32",
                          f"scaling{u}": "fp32"})
        sig = {a: (mangle_type(descs[a]) if a in descs else "constexpr" if a in consts
                   else types.get(a, "i32")) for a in fn.arg_names}
        src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(c),): v
                                                  for c, v in consts.items()}, attrs={})
        kern = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": WARPS, "maxnreg": maxnreg,
                                       "enable_fp_fusion": False})
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(kern.asm["cubin"])
        nvdis = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
        sass = subprocess.run([nvdis, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
        os.unlink(f.name)
        ops = collections.Counter(
            m.group(2).split(".")[0] for m in
            (re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", ln)
             for ln in sass.splitlines()) if m)
        regs = sorted(set(re.findall(r"SETMAXREG[.A-Z_]*\s+(?:UP0,\s*)?(0x[0-9a-f]+)", sass)))
        print(f"lab_b lora={lora} glu={glu} maxnreg={maxnreg}: shared {kern.metadata.shared} B, "
              f"setmaxnreg {regs}, spill stores {sass.count('STL')} loads {sass.count('LDL')}, "
              f"PRMT {ops['PRMT']} HMMA {ops['HMMA']} LDS {ops['LDS']} total {sum(ops.values())}")


if __name__ == "__main__":
    import sys

    compile_check(int(sys.argv[1]) if len(sys.argv) > 1 else MAXNREG)
