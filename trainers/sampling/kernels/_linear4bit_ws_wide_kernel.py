"""The gate/up + silu · mul launch of the warp-specialized decode linear on eight consumer warps
(sm_90, Gluon); `linear4bit_ws` decides and launches.

    y = silu(x @ round(W_g)ᵀ + s_g · B_g t_g) · (x @ round(W_u)ᵀ + s_u · B_u t_u)

`_linear4bit_ws_kernel`'s GLU launch through the pair table (its module docstring has the
ring, the lookup, the K permutation and the bound), for double-quant absmax of 64-element
blocks, with LoRA's t given (`lora_t`) or no LoRA, on twice the consumer warps. Warp
4·g + w takes MMA rows 16·w .. 16·w + 15 (stage rows 32·rb + 8·w + l // 4) of chunks 2·g and
2·g + 1 of every step: half the four-warp kernel's words, lookups and x a thread, so that at
two CTAs a SM each scheduler holds four consumer warps' independent chains instead of two.

Sums: chunk Q's MMA from zero, times its scale, into acc_Q (each warp its two chunks' acc_Q
over the steps), and y = (acc_0 + acc_1) + (acc_2 + acc_3), the first pair warp group 0's and
the second warp group 1's, added once after the K loop: the four-warp kernel's fp32 sums in its
order, so both give the same bits.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from . import _linear4bit_ws_kernel as WK

ROWS = WK.ROWS
STEP_WORDS = WK.STEP_WORDS
RANK = WK.RANK

# the stage's words (64 rows ρ, 32 words 8·Q + 4·h + j) as the consumer holds them: lanes j
# and ρ's bits 0-2, registers h, Q's bit 0 and ρ's bit 5 (rb), warps ρ's bits 3-4 (w) and Q's
# bit 1 (g)
WORDS_8 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 4], [0, 8], [32, 0]],
    lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[8, 0], [16, 0], [0, 16]], block_bases=[], shape=[ROWS.value, STEP_WORDS.value]))
# one chunk of each warp group's pair, (g, ρ, h, j)
WORDS_Q8 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1, 0], [0, 32, 0, 0]],
    lane_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
    warp_bases=[[0, 8, 0, 0], [0, 16, 0, 0], [1, 0, 0, 0]], block_bases=[],
    shape=[2, ROWS.value, 2, 4]))
# x (8 rows m, chunk Q, column 32·h + 8·j + 2·i + E): lane l row l // 4 and j = l % 4, the
# registers the rest of the warp group's two chunks
XLOAD_8 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 32], [0, 1, 0]],
    lane_bases=[[0, 0, 8], [0, 0, 16], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[0, 0, 0], [0, 0, 0], [0, 2, 0]], block_bases=[], shape=[8, 4, 64]))
# the MMAs batched over the warp groups: (g, 64 MMA rows, 8) from (g, 64, 64) and (g, 64, 8)
MMA8 = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, 4, 1],
                                              instr_shape=[1, 16, 8]))
A_OP8 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA8, k_width=2))
B_OP8 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA8, k_width=2))
SCALE_8 = gl.constexpr(gl.SliceLayout(2, MMA8))  # a chunk's scales (g, MMA row)
ACC = gl.constexpr(gl.SliceLayout(0, MMA8))  # the summed (64, 8), every warp group a copy
LORA3_8 = gl.constexpr(gl.BlockedLayout([1, RANK.value, 1], [8, 1, 4], [8, 1, 1], [2, 1, 0]))
T_GIVEN_8 = gl.constexpr(gl.BlockedLayout([1, 1], [4, 8], [8, 1], [1, 0]))
PAIR_FILL_8 = gl.constexpr(gl.BlockedLayout([1, 1], [1, 32], [8, 1], [1, 0]))


@gluon.jit
def _fill_pair_table(table, code_ptr):
    """`_linear4bit_ws_kernel._fill_pair_table` by eight warps."""
    e = gl.arange(0, 256, layout=gl.SliceLayout(1, PAIR_FILL_8))
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, PAIR_FILL_8))
    first = gl.load(code_ptr + (e >> 4)).to(gl.bfloat16).to(gl.int16, bitcast=True)
    second = gl.load(code_ptr + (e & 15)).to(gl.bfloat16).to(gl.int16, bitcast=True)
    pair = (first.to(gl.int32) & 0xFFFF) | (second.to(gl.int32) << 16)
    table.store(gl.broadcast(pair[:, None], lane[None, :])[0])


@gluon.jit
def _chunk_a(w, base):
    """Each warp group's chunk's (g, 64, 64) A operand from its words w (g, ρ, h, j)."""
    b0, b1, b2, b3 = gl.inline_asm_elementwise(
        WK.PAIR_LOOKUP, "=r,=r,=r,=r,r,r", [w, base],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    v = gl.reshape(WK._pair_values(b0, b1, b2, b3), [2, 2, 4, 8, 2, 4, 2, 2, 2])
    # [g, rb, w, r8, h, j, E, i0, i1] -> [g, w, rb, r8, h, i1, i0, j, E]
    v = gl.permute(v, (0, 2, 1, 3, 4, 8, 7, 5, 6))
    return gl.convert_layout(gl.reshape(v, [2, 64, 64]), A_OP8, assert_trivial=True)


@gluon.jit
def _chunk_x(xq):
    """(g, 64, 8) B operand from x's columns [g, h, i1, i0, j, E, m] of the chunk."""
    return gl.convert_layout(gl.reshape(xq, [2, 64, 8]), B_OP8, assert_trivial=True)


@gluon.jit
def _step_mma(words, xv, base, s0, s1, acc0, acc1):
    """A step's words (64, 32) in WORDS_8 times x (8, 4, 64) in XLOAD_8: each warp group's
    chunk 2·g + q MMA sum (from zero), times its scale s_q (g, 64), into acc_q."""
    w5 = gl.permute(gl.reshape(words, [64, 2, 2, 2, 4]), (1, 0, 3, 4, 2))  # [g, ρ, h, j, q]
    w0, w1 = gl.split(w5)
    x8 = gl.reshape(xv, [8, 2, 2, 2, 4, 2, 2, 2])  # [m, g, q, h, j, i1, i0, E]
    x0, x1 = gl.split(gl.permute(x8, (1, 3, 5, 6, 4, 7, 0, 2)))  # [g, h, i1, i0, j, E, m]
    zero = gl.zeros([2, 64, 8], gl.float32, MMA8)
    a0 = _chunk_a(gl.convert_layout(w0, WORDS_Q8, assert_trivial=True), base)
    acc0 = gl.fma(mma_v2(a0, _chunk_x(x0), zero), s0[:, :, None], acc0)
    a1 = _chunk_a(gl.convert_layout(w1, WORDS_Q8, assert_trivial=True), base)
    acc1 = gl.fma(mma_v2(a1, _chunk_x(x1), zero), s1[:, :, None], acc1)
    return acc0, acc1


@gluon.jit
def _rows():
    """The weight rows (stage order) of the MMA rows, (64,) as the scales take them."""
    r = gl.arange(0, 64, layout=gl.SliceLayout(0, SCALE_8))
    return WK._stage_row(r)


@gluon.jit
def _scale_operands(absmax_ptr, absmax2_ptr, row0, N, K, step, BS2: gl.constexpr):
    """Each row's int32 word of its four chunks' code indices of `step`, and the row's
    second-level scale of the step (its four blocks share one: BS2 a multiple of 4), (64,)
    each; rows past N 0."""
    row = row0 + _rows()
    words = absmax_ptr.to(gl.pointer_type(gl.int32))
    qa = gl.load(words + row * (K // 256) + step, mask=row < N, other=0)
    first = (row * (K // 64) + step * 4).to(gl.uint32)
    return qa, gl.load(absmax2_ptr + first // BS2, mask=row < N, other=0.0)


@gluon.jit
def _scales(qa, a2, code2_ptr, offset):
    """Chunks 2·g and 2·g + 1's scales (g, 64): code2[byte] · absmax2 + offset (two roundings,
    bitsandbytes' order; the kernel runs without FMA contraction)."""
    g = gl.arange(0, 2, layout=gl.SliceLayout(1, SCALE_8))
    shift = 16 * g[:, None]
    q0 = (qa[None, :] >> shift) & 0xFF
    q1 = (qa[None, :] >> (shift + 8)) & 0xFF
    a2 = a2[None, :]
    return (gl.load(code2_ptr + q0) * a2 + offset, gl.load(code2_ptr + q1) * a2 + offset)


@gluon.jit
def _k_loop(table, bufs, xbufs, ready, empty, code_ptr, absmax_ptr, absmax2_ptr, code2_ptr,
            offset_ptr, row0, N, K, nsteps, i0, BS2: gl.constexpr, STAGES: gl.constexpr,
            FILL: gl.constexpr):
    """One projection's K loop over the ring's stages i0 .. i0 + nsteps - 1, (64, 8) fp32 by
    MMA row in ACC. The scale operands load two steps ahead and the scales one step ahead (as
    the four-warp kernel's); with FILL the consumer warps fill the pair table after the first
    step's scale loads are issued."""
    offset = gl.load(offset_ptr)
    acc0 = gl.zeros([2, 64, 8], gl.float32, MMA8)
    acc1 = acc0
    base = WK._pair_table_base(gl.zeros([2, 64, 2, 4], gl.int32, WORDS_Q8))
    last = nsteps - 1
    qa, a2 = _scale_operands(absmax_ptr, absmax2_ptr, row0, N, K, 0, BS2)
    s0, s1 = _scales(qa, a2, code2_ptr, offset)
    qa_next, a2_next = _scale_operands(absmax_ptr, absmax2_ptr, row0, N, K,
                                       gl.minimum(1, last), BS2)
    if FILL:
        _fill_pair_table(table, code_ptr)
        WK.cta_barrier()
    for i in range(nsteps):
        n0, n1 = _scales(qa_next, a2_next, code2_ptr, offset)
        s = (i0 + i) % STAGES
        mbarrier.wait(ready.index(s), ((i0 + i) // STAGES) & 1)
        words = bufs.index(s).load(WORDS_8)
        xv = xbufs.index(s).load(XLOAD_8)
        qa_after, a2_after = _scale_operands(absmax_ptr, absmax2_ptr, row0, N, K,
                                             gl.minimum(i + 2, last), BS2)
        acc0, acc1 = _step_mma(words, xv, base, s0, s1, acc0, acc1)
        mbarrier.arrive(empty.index(s), count=1)  # after the MMAs: `WK._step` says why
        s0, s1 = n0, n1
        qa_next, a2_next = qa_after, a2_after
    return gl.sum(acc0 + acc1, axis=0)


@gluon.jit
def _given_t(t_ptr, stride_tp, stride_tr, j, M, T_PARTS: gl.constexpr):
    """`_linear4bit_ws_kernel._given_t` by eight warps (one split: split 0's t)."""
    r = gl.arange(0, RANK, layout=gl.SliceLayout(1, T_GIVEN_8))
    m = gl.arange(0, 8, layout=gl.SliceLayout(0, T_GIVEN_8))
    ptrs = t_ptr + (j * RANK + r[:, None]) * stride_tr + m[None, :]
    mask = (r < RANK)[:, None] & (m < M)[None, :]
    t = gl.zeros([RANK, 8], gl.float32, T_GIVEN_8)
    for p in gl.static_range(T_PARTS):
        t += gl.load(ptrs + p * stride_tp, mask=mask, other=0.0)
    return gl.convert_layout(t, gl.SliceLayout(0, LORA3_8))


@gluon.jit
def _lora_b(b_ptr, row0, N, stride_bn):
    """B[tile] (64, 16) bf16 in the rank-sum layout, rows in stage order (rows past N: 0)."""
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, LORA3_8)))
    j = gl.arange(0, RANK, layout=gl.SliceLayout(0, gl.SliceLayout(2, LORA3_8)))
    n = row0 + WK._stage_row(r)
    return gl.load(b_ptr + n[:, None] * stride_bn + j[None, :],
                   mask=(n < N)[:, None] & (j < RANK)[None, :], other=0.0)


@gluon.jit
def _lora_term(t3, b, scaling):
    """s · B[tile] @ t (64, 8) fp32 in ACC."""
    lora = gl.sum(b.to(gl.float32)[:, :, None] * t3[None, :, :], axis=1)
    return gl.convert_layout(lora * scaling, ACC)


@gluon.jit
def _consumer(table, bufs, xbufs, ready, empty,
              code_ptr0, absmax_ptr0, absmax2_ptr0, code2_ptr0, offset_ptr0,
              code_ptr1, absmax_ptr1, absmax2_ptr1, code2_ptr1, offset_ptr1,
              row0, N, K, nsteps, BS2: gl.constexpr, STAGES: gl.constexpr):
    """The gate's sums (its rows' stages first), then the up projection's."""
    acc = _k_loop(table, bufs, xbufs, ready, empty, code_ptr0, absmax_ptr0, absmax2_ptr0,
                  code2_ptr0, offset_ptr0, row0, N, K, nsteps, 0, BS2, STAGES, True)
    acc_u = _k_loop(table, bufs, xbufs, ready, empty, code_ptr1, absmax_ptr1, absmax2_ptr1,
                    code2_ptr1, offset_ptr1, row0, N, K, nsteps, nsteps, BS2, STAGES, False)
    return acc, acc_u


@gluon.jit
def linear4bit_ws_wide_kernel(x_desc, y_ptr, t_ptr, stride_tp, stride_tr,
                              w_desc0, b_ptr0, code_ptr0, absmax_ptr0, absmax2_ptr0,
                              code2_ptr0, offset_ptr0, scaling0, stride_bn0, bias_ptr0,
                              w_desc1, b_ptr1, code_ptr1, absmax_ptr1, absmax2_ptr1,
                              code2_ptr1, offset_ptr1, scaling1, stride_bn1, bias_ptr1,
                              N, K, M, stride_ym, BS2: gl.constexpr, STAGES: gl.constexpr,
                              HAS_LORA: gl.constexpr, HAS_BIAS: gl.constexpr,
                              PDL: gl.constexpr, EARLY_NEXT: gl.constexpr,
                              PRODUCER_REGS: gl.constexpr, T_PARTS: gl.constexpr):
    """Grid (N / 64 tiles,): y (M, N) bf16 = silu(gate) · up of the tile's rows, gate and up
    each N x K, double-quant 4-bit with 64-element blocks. HAS_LORA needs T_PARTS > 0 (t as
    `lora_t`'s parts at t_ptr); HAS_BIAS adds bias_ptr_s to each projection before its
    rounding. PDL and EARLY_NEXT as `_linear4bit_ws_kernel.linear4bit_ws_kernel`'s."""
    gl.static_assert(T_PARTS > 0 or not HAS_LORA, "LoRA's t comes with the launch")
    row0 = gl.program_id(0) * ROWS
    nsteps = K // 256
    table = gl.allocate_shared_memory(gl.int32, [256, 32], WK.PAIR_TABLE_LAYOUT)
    bufs = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, STEP_WORDS], w_desc0.layout)
    xbufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 8, 4, 64], x_desc.layout)
    abufs = gl.allocate_shared_memory(gl.bfloat16, [1, 8, 4, 64], x_desc.layout)  # unread
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    acc, acc_u = gl.warp_specialize([
        (_consumer, (table, bufs, xbufs, ready, empty,
                     code_ptr0, absmax_ptr0, absmax2_ptr0, code2_ptr0, offset_ptr0,
                     code_ptr1, absmax_ptr1, absmax2_ptr1, code2_ptr1, offset_ptr1,
                     row0, N, K, nsteps, BS2, STAGES)),
        (WK._producer, (x_desc, w_desc0, x_desc, w_desc1, x_desc, w_desc1, x_desc, bufs,
                        xbufs, abufs, ready, empty, 0, row0, 0, nsteps, STAGES, False, True,
                        PDL)),
    ], [1], [PRODUCER_REGS])
    table._keep_alive()  # its lookups are inline PTX: its bytes stay the table's
    if EARLY_NEXT:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)
    if HAS_LORA:
        acc += _lora_term(_given_t(t_ptr, stride_tp, stride_tr, 0, M, T_PARTS),
                          _lora_b(b_ptr0, row0, N, stride_bn0), scaling0)
        acc_u += _lora_term(_given_t(t_ptr, stride_tp, stride_tr, 1, M, T_PARTS),
                            _lora_b(b_ptr1, row0, N, stride_bn1), scaling1)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
    m = gl.arange(0, 8, layout=gl.SliceLayout(0, ACC))
    nr = row0 + WK._stage_row(r)
    if HAS_BIAS:
        acc += gl.load(bias_ptr0 + nr, mask=nr < N, other=0.0).to(gl.float32)[:, None]
        acc_u += gl.load(bias_ptr1 + nr, mask=nr < N, other=0.0).to(gl.float32)[:, None]
    gl.store(y_ptr + m[None, :] * stride_ym + nr[:, None], WK._silu_mul(acc, acc_u),
             mask=(nr < N)[:, None] & (m < M)[None, :])
