"""The warp-specialized decode linear's Gluon kernel (sm_90); `linear4bit_ws` decides and launches.

    y = x @ round(W)ᵀ + bias + s · (x @ Aᵀ) @ Bᵀ    x (M <= 8, K) bf16, W bitsandbytes 4-bit
                                                 (N, K), A (16, K) and B (N, 16) bf16 LoRA
                                                 factors, bias (N,) or none

One CTA computes a 64-row tile of W over one K split. A producer warp copies each step's
64 x 256 packed weights (TMA, 128-byte swizzle; int32 words), x's 8 x 256 and A's 16 x 256
(each as (rows, 4 chunks, 64), a chunk one swizzled 128-byte row) into a ring of STAGES
shared-memory stages; the 4 consumer warps (the default partition) read a stage, look its
nibbles up and run mma.sync m16n8k16. With ρ a row of the stage and thread (warp w, lane l),
Q = l % 4 (chunk Q of the step: 64 elements, one absmax block or part of one):

    words  rows ρ = 32·rb + 8·w + l // 4 (rb = 0, 1), words 8·Q + 4·h + j (half h, j < 4)
    A_h    the (64, 128) left operand of half h: row r = 16·w + 8·rb + l // 4 is stage row ρ,
           column c = 32·j + 8·i + 2·Q + E is element E of byte i of word j
    x_h    the (128, 8) right operand: column c is x[:, 256·step + 64·Q + 32·h + 8·j + 2·i + E]

so what a thread looks up is its MMA operand (every layout conversion asserts that it moves no
data); the dot sums K in that permuted order. Two lookups (PAIR_TABLE, `linear4bit_ws` picks):

- Register tables, `linear4bit`'s: per row and chunk the 16 values round(code[i] · scale) as
  byte planes (`_table_asm`), then byte permutes (`_PAIRS_ASM`), so the weight is round(W) bit
  for bit. About two ALU operations a weight.
- The pair table: the code's 256 byte values as bf16 pairs (round(code[hi]), round(code[lo])),
  in shared memory, one copy per lane (conflict-free); a byte is one 32-bit load, its pair
  the MMA operand register as it is. The K permutation swaps the roles of Q and j (WORDS_C:
  the lane holds word j, the registers the chunks), so each MMA sums one chunk, from zero, and
  its fp32 sum is scaled once: y = Σ_chunks scale · Σ round(code) · x. The weight is then
  round(code) · scale, within (2u + u²) |code · scale| <= (2 + u) / (1 - u) · u · |round(W)|
  of round(W) (u = 2⁻⁸: two roundings to bf16 of the same value), each product exact in fp32.
  Under half the ALU work; the loads go to the shared-memory pipe, which the register tables
  leave idle.

The scale operands are loaded two steps ahead and the scale gathered one step ahead, in
registers; the step's MMAs run in four independent chains, summed at the end. A stage goes
back to the producer after the MMAs that read it (`_step`).

The LoRA factor t = A @ xᵀ (fp32, never rounded) is split over the warps: warp w sums the
columns 8·w .. 8·w + 7 of each half of each chunk (a batched MMA, the batch over warps), and the
warps' parts are summed once after the loop; the epilogue adds s · B[tile] @ t in fp32 (each K
split its own t_split: the term is linear in t) and the bias. Or t comes with the launch
(T_PARTS > 0: `lora_t`, formed by the kernel that wrote x): the producer then copies no A, the
loop runs no t MMAs, and the epilogue sums t's parts (split 0 adds the term, the others none).
Every sum is fp32 with one
rounding of y, so the output meets `linear4bit`'s bound (with the pair table, plus the
weights' (2 + u) / (1 - u) · u · Σ|x||round(W)|). Split K writes fp32 partials
(SPLIT_K, M, Σ N_s) without the bias, which their sum adds.

Segments (q, k and v in one launch): the grid's tiles are the segments' tiles one after the
other; a CTA finds its segment from its tile index and reads that projection's descriptors and
pointers (uniform branches), and writes its output columns at the segment's offset.
GLU (gate and up of an MLP, one split): each CTA streams the gate's rows of its tile, then the
up's, through the same ring, and writes silu(gate) · up with `linear4bit._silu_mul`'s
roundings, so neither projection goes to memory.

PDL: the producer copies the first STAGES stages' weights (and A), waits for the kernel before
(griddepcontrol.wait), then copies their x; with EARLY_NEXT the CTA lets the next kernel launch
after its K loop (griddepcontrol.launch_dependents), before the epilogue.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.language.extra import libdevice

from . import linear4bit as L

# the TMA load into shared memory: `async_load` in newer Tritons, `async_copy_global_to_shared`
# before (where the new name is absent)
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# a barrier of the CTA's threads: `barrier` in newer Tritons, `thread_barrier` before
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

ROWS = gl.constexpr(64)  # weight rows (output features) a CTA computes
STEP_WORDS = gl.constexpr(32)  # int32 words of a row a step: 256 columns of K
RANK = gl.constexpr(16)  # the LoRA rank the kernel takes
TABLE = gl.constexpr(L._table_asm("cvt.rn.bf16x2.f32"))
TABLE_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 8 + ["r"] * 17))
PAIRS = gl.constexpr(L._PAIRS_ASM)
PAIRS_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 9))

# the stage's words as the consumer holds them (module docstring), loaded from shared memory
WORDS2 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [32, 0]],
    lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[8, 0], [16, 0]], block_bases=[], shape=[ROWS.value, STEP_WORDS.value]))
# the same registers as (rows, chunk Q, word 4·h + j): a blocked layout, so that a chunk's
# scale (64, 4, 1) broadcasts over its words
WORDS3 = gl.constexpr(gl.BlockedLayout([1, 1, 8], [8, 4, 1], [4, 1, 1], [2, 1, 0]))
# a half's words (rows, chunk Q, j), and the chunk tables (64, 4, 1) broadcast over them
HALF = gl.constexpr(gl.BlockedLayout([1, 1, 4], [8, 4, 1], [4, 1, 1], [2, 1, 0]))
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1],
                                             instr_shape=[16, 8]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
# a stage's x (8 rows, chunk Q, its 64 columns): each thread both halves' 32 elements of its
# row and chunk, every warp all of x; the swizzle puts a quarter warp's 8 lanes (4 chunks x 2
# rows) in 8 bank groups
XLOAD = gl.constexpr(gl.BlockedLayout([1, 1, 64], [8, 4, 1], [1, 1, 4], [2, 1, 0]))
# t's warp split (module docstring): a batched MMA, the batch (the column slice) over warps
MMA3 = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1],
                                              instr_shape=[1, 16, 8]))
A3_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA3, k_width=2))
B3_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA3, k_width=2))
# a stage's A (16 ranks, chunk Q, 64 columns) and x (8 rows, Q, 64) as those warps read them:
# lanes over Q and the rank (row), registers over a slice's 8 elements, rank + 8 and the half,
# warps over the slices
A_SPLIT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [8, 0, 0], [0, 0, 32]],
    lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[0, 0, 8], [0, 0, 16]], block_bases=[], shape=[RANK.value, 4, 64]))
X_SPLIT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 32]],
    lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[0, 0, 8], [0, 0, 16]], block_bases=[], shape=[8, 4, 64]))
# the epilogue's s · B[tile] @ t in fp32: (64 rows n, 16 ranks, 8 rows m), a thread all 16
# ranks of its (n, m) pairs, so the sum over ranks stays in its registers
LORA3 = gl.constexpr(gl.BlockedLayout([1, RANK.value, 1], [8, 1, 4], [4, 1, 1], [2, 1, 0]))
# a given t (16 ranks, 8 rows) one element a thread of the four consumer warps (`_given_t`)
T_GIVEN = gl.constexpr(gl.BlockedLayout([1, 1], [4, 8], [4, 1], [1, 0]))


# The pair table's lookup (module docstring). Thread (warp w, lane l) holds word 8·Q + 4·h + j
# of stage rows ρ = 32·rb + 8·w + l // 4 with j = l % 4 and (Q, h, rb) in registers; chunk Q's
# (64, 64) A operand has column c = 32·h + 16·i1 + 8·i0 + 2·j + E for element E of byte
# i = 2·i1 + i0 of word j, half h, and x's (64, 8) operand row c the same column of the chunk:
# every MMA sums one chunk (one absmax block or part of one).
WORDS_C = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 4], [0, 8], [0, 16], [32, 0]],
    lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[8, 0], [16, 0]], block_bases=[], shape=[ROWS.value, STEP_WORDS.value]))
# a chunk's words (rows, h, j) as WORDS_C holds them
WORDS_Q = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1, 0], [32, 0, 0]],
    lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[8, 0, 0], [16, 0, 0]], block_bases=[], shape=[ROWS.value, 2, 4]))
# x (8 rows m, chunk Q, column 32·h + 8·j + 2·i + E) as the MMAs take it: lane l holds row
# l // 4 and columns with j = l % 4, every warp all of x
XLOAD_C = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 32], [0, 1, 0], [0, 2, 0]],
    lane_bases=[[0, 0, 8], [0, 0, 16], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[0, 0, 0], [0, 0, 0]], block_bases=[], shape=[8, 4, 64]))
# the code's byte-pair table in shared memory: entry e of lane l at word 32·e + l (each lane its
# own bank: no two lanes of a warp conflict), e's high nibble's value in the lower half
PAIR_TABLE_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
PAIR_FILL = gl.constexpr(gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0]))
# PTX, one word $4 at a time: its bytes' entries ($0 .. $3, byte i in $i) from the table at
# global_smem's start, entry e of lane l at global_smem + 128 · e + 4 · l with $5 = 4 · l. The
# byte lands in bits 7..14 (the `and`), 4 · l lies in bits 2..6, so the `or` is the sum and
# shift + and + or fold into one LOP3 after the shift; global_smem is a link-time constant
# that ptxas folds into the load's immediate offset.
PAIR_LOOKUP = gl.constexpr("{\n.reg .b32 t0, t1, t2, t3, g;\nmov.u32 g, global_smem;\n" + "\n".join(
    [f"{op} t{i}, $4, {sh};\nand.b32 t{i}, t{i}, 0x7F80;\nor.b32 t{i}, t{i}, $5;\n"
     f"add.u32 t{i}, t{i}, g;\n"
     f"ld.shared.b32 ${i}, [t{i}];"
     for i, (op, sh) in enumerate((("shl.b32", 7), ("shr.u32", 1), ("shr.u32", 9),
                                    ("shr.u32", 17)))]) + "\n}")

# the chunk scales (64 MMA rows, chunk Q): each thread its MMA rows' four, as the accumulator
# holds those rows (the lanes of a quad alike)
SCALE_C3 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1, 0], [0, 2, 0], [8, 0, 0]],
    lane_bases=[[0, 0, 0], [0, 0, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[ROWS.value, 4, 1]))
SCALE_C = gl.constexpr(gl.SliceLayout(2, SCALE_C3))


@gluon.jit
def _fill_pair_table(table, code_ptr):
    """Entry e of every lane's copy: (round(code[e >> 4]), round(code[e & 15])) as bf16, the
    first in the lower half."""
    e = gl.arange(0, 256, layout=gl.SliceLayout(1, PAIR_FILL))
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, PAIR_FILL))
    first = gl.load(code_ptr + (e >> 4)).to(gl.bfloat16).to(gl.int16, bitcast=True)
    second = gl.load(code_ptr + (e & 15)).to(gl.bfloat16).to(gl.int16, bitcast=True)
    pair = (first.to(gl.int32) & 0xFFFF) | (second.to(gl.int32) << 16)
    table.store(gl.broadcast(pair[:, None], lane[None, :])[0])


@gluon.jit
def _pair_table_base(like):
    """4 · lane, the lane's offset into the table, shaped as `like` (the table is the kernel's
    first shared allocation, at global_smem's start: `tests/_compile_decode_kernels.py`
    checks)."""
    lane = gl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [like], dtype=gl.int32,
                                     is_pure=True, pack=1)
    return lane * 4


@gluon.jit
def _chunk_a(w, base):
    """Chunk Q's (64, 64) A operand from its words w (64, 2, 4) [ρ, h, j] in WORDS_Q."""
    b0, b1, b2, b3 = gl.inline_asm_elementwise(
        PAIR_LOOKUP, "=r,=r,=r,=r,r,r", [w, base],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    # [rb, w, r8, h, j, E, i0, i1]
    v = gl.reshape(_pair_values(b0, b1, b2, b3), [2, 4, 8, 2, 4, 2, 2, 2])
    v = gl.permute(v, (1, 0, 2, 3, 7, 6, 4, 5))  # [w, rb, r8, h, i1, i0, j, E]
    return gl.convert_layout(gl.reshape(v, [64, 64]), A_OP, assert_trivial=True)


@gluon.jit
def _quarters(v):
    """The four (.., n) slices of v (.., 4, n) along its second-last axis, in order."""
    shape: gl.constexpr = v.shape
    lead: gl.constexpr = shape[0]
    n: gl.constexpr = shape[-1]
    v = gl.permute(gl.reshape(v, [lead, 2, 2, n]), (0, 3, 1, 2))  # [.., n, Q // 2, Q % 2]
    even, odd = gl.split(v)  # split takes the last axis: Q % 2
    q0, q2 = gl.split(even)
    q1, q3 = gl.split(odd)
    return q0, q1, q2, q3


@gluon.jit
def _chunk_x(xq):
    """Chunk Q's (64, 8) B operand from x's (8, 64) columns of the chunk."""
    v = gl.reshape(xq, [8, 2, 4, 2, 2, 2])  # [m, h, j, i1, i0, E]
    v = gl.permute(v, (1, 3, 4, 2, 5, 0))  # [h, i1, i0, j, E, m]
    return gl.convert_layout(gl.reshape(v, [64, 8]), B_OP, assert_trivial=True)


@gluon.jit
def _chunk_step(words, xv, base, scale, acc0, acc1, acc2, acc3):
    """A step's words (64, 32) in WORDS_C times x (8, 4, 64) in XLOAD_C: chunk Q's MMA sum
    (from zero), times its scale (column Q of `scale`, (64, 4) in SCALE_C), into acc_Q."""
    w0, w1, w2, w3 = _quarters(gl.reshape(words, [64, 4, 8]))
    x0, x1, x2, x3 = _quarters(xv)
    s0, s1, s2, s3 = _quarters(scale[:, :, None])
    zero = gl.zeros([64, 8], gl.float32, MMA)
    acc0 = _chunk_mma(w0, x0, s0, base, zero, acc0)
    acc1 = _chunk_mma(w1, x1, s1, base, zero, acc1)
    acc2 = _chunk_mma(w2, x2, s2, base, zero, acc2)
    acc3 = _chunk_mma(w3, x3, s3, base, zero, acc3)
    return acc0, acc1, acc2, acc3


@gluon.jit
def _chunk_mma(w, x, s, base, zero, acc):
    """acc + s · (chunk's A @ x) in fp32: w (64, 8) its words [ρ, 4·h + j], x (8, 64), s (64, 1)
    its scales by MMA row."""
    a = _chunk_a(gl.convert_layout(gl.reshape(w, [64, 2, 4]), WORDS_Q, assert_trivial=True),
                 base)
    s = gl.convert_layout(gl.reshape(s, [64]), gl.SliceLayout(1, MMA), assert_trivial=True)
    return gl.fma(mma_v2(a, _chunk_x(x), zero), s[:, None], acc)


@gluon.jit
def _pair_values(b0, b1, b2, b3):
    """The bf16 values of the pairs b_i (byte i of each word, the first value in the lower
    half) along new last axes [E, i0, i1], i = 2·i1 + i0."""
    return gl.join(gl.join(_halves(b0), _halves(b1)), gl.join(_halves(b2), _halves(b3)))


@gluon.jit
def _halves(w):
    """The two bf16 of each int32 word w (lower half first) along a new last axis."""
    lo = (w & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
    hi = (w >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.join(lo, hi)


@gluon.jit
def _codes(code_ptr):
    """The 16 entries of the 4-bit code (NF4's or FP4's values), each a scalar for `_table`."""
    return (gl.load(code_ptr + 0), gl.load(code_ptr + 1), gl.load(code_ptr + 2),
            gl.load(code_ptr + 3), gl.load(code_ptr + 4), gl.load(code_ptr + 5),
            gl.load(code_ptr + 6), gl.load(code_ptr + 7), gl.load(code_ptr + 8),
            gl.load(code_ptr + 9), gl.load(code_ptr + 10), gl.load(code_ptr + 11),
            gl.load(code_ptr + 12), gl.load(code_ptr + 13), gl.load(code_ptr + 14),
            gl.load(code_ptr + 15))


@gluon.jit
def _table(scale, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    """linear4bit's 8 table words (round(code · scale) as byte planes) of each scale."""
    return gl.inline_asm_elementwise(
        TABLE, TABLE_CONSTRAINTS,
        [scale, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32),
        is_pure=True, pack=1)


@gluon.jit
def _scale_operands(absmax_ptr, absmax2_ptr, row0, N, K, step, BS: gl.constexpr,
                    BS2: gl.constexpr, NESTED: gl.constexpr, PAIR: gl.constexpr):
    """(64, 4) operands of the scale of each row's chunk Q of `step` (rows past N: 0), all
    32-bit (loop-carried as whole registers, so nothing repacks them while they load): with
    double quant and BS 64 the int32 word of a row's four code indices of the step (`_scale`
    takes byte Q), else the index or the absmax itself; and the second-level scale (or the
    absmax again). By stage row in SliceLayout(2, HALF) for the register tables; with PAIR by
    MMA row in SCALE_C, the row's word then (64,), and the second-level scale (64, 1) where the
    step's blocks share one (`_row_absmax2`)."""
    if PAIR:
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, SCALE_C))
        q = gl.arange(0, 4, layout=gl.SliceLayout(0, SCALE_C))
        row = row0 + _stage_row(r)
    else:
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, HALF)))
        q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, HALF)))
        row = row0 + r
    # the block indices are >= 0: unsigned, so that // BS2 (a power of two) is one shift
    blk = (row[:, None] * (K // BS) + (step * 4 + q[None, :]) // (BS // 64)).to(gl.uint32)
    ok = (row[:, None] < N) & (q[None, :] < 4)
    if NESTED:
        if BS == 64:
            words = absmax_ptr.to(gl.pointer_type(gl.int32))
            if PAIR:  # the chunks are a thread's registers: one load a row
                qa = gl.load(words + row * (K // 256) + step, mask=row < N, other=0)
            else:  # the chunks are lanes
                qa = gl.load(words + (row[:, None] * (K // 256) + step) + 0 * q[None, :],
                             mask=ok, other=0)
        else:
            qa = gl.load(absmax_ptr + blk, mask=ok, other=0).to(gl.int32)
        if PAIR and _row_absmax2(BS, BS2):  # one load a row
            first = (row * (K // BS) + step * (256 // BS)).to(gl.uint32)
            return qa, gl.load(absmax2_ptr + first // BS2, mask=row < N, other=0.0)[:, None]
        else:
            return qa, gl.load(absmax2_ptr + blk // BS2, mask=ok, other=0.0)
    else:
        a = gl.load(absmax_ptr + blk, mask=ok, other=0.0)
        return a, a


@gluon.constexpr_function
def _row_absmax2(BS, BS2):
    """Whether a step's 256 // BS blocks of a row share one second-level scale: a row starts
    at a multiple of 256 // BS blocks (K is a multiple of 256), and so does each step, so
    where BS2 is a multiple of 256 // BS no group of BS2 blocks starts inside a step."""
    return BS2 % (256 // BS) == 0


@gluon.jit
def _scale(qa, a2, code2_ptr, offset, BS: gl.constexpr, NESTED: gl.constexpr,
           PAIR: gl.constexpr):
    """code2[qa] · absmax2 + offset (two roundings: the kernel runs without FMA contraction, as
    bitsandbytes forms it), or the absmax; `_scale_operands`' layout."""
    if NESTED:
        if BS == 64:  # byte Q of the row's word
            if PAIR:
                q = gl.arange(0, 4, layout=gl.SliceLayout(0, SCALE_C))
                qa = (qa[:, None] >> (8 * q[None, :])) & 0xFF
            else:
                q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, HALF)))
                qa = (qa >> (8 * q[None, :])) & 0xFF
        return gl.load(code2_ptr + qa) * a2 + offset
    else:
        return qa


@gluon.jit
def _a_tile(w, t0, t1, t2, t3, t4, t5, t6, t7):
    """The (64, 128) A operand of a half step from its words w (64, 4, 4) [ρ, Q, j] and the
    chunk tables (64, 4, 1)."""
    b0, b1, b2, b3 = gl.inline_asm_elementwise(
        PAIRS, PAIRS_CONSTRAINTS, [w, t0, t1, t2, t3, t4, t5, t6, t7],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    return _pairs_a(b0, b1, b2, b3)


@gluon.jit
def _pairs_a(b0, b1, b2, b3):
    """The (64, 128) A operand from the pairs b_i (64, 4, 4) [ρ, Q, j] of each word's byte i
    (two bf16, the first in the lower half)."""
    # [rb, w, r8, Q, j, E, i0, i1]
    v = gl.reshape(_pair_values(b0, b1, b2, b3), [2, 4, 8, 4, 4, 2, 2, 2])
    v = gl.permute(v, (1, 0, 2, 4, 7, 6, 3, 5))  # [w, rb, r8, j, i1, i0, Q, E]
    return gl.convert_layout(gl.reshape(v, [64, 128]), A_OP, assert_trivial=True)


@gluon.jit
def _x_tile(xh):
    """The (128, 8) B operand from x's (8, 4, 32) [m, Q, e] columns 64·Q + 32·h + e, K
    permuted as the module docstring says."""
    v = gl.reshape(xh, [8, 4, 4, 2, 2, 2])  # [m, Q, j, i1, i0, E]
    v = gl.permute(v, (2, 3, 4, 1, 5, 0))  # [j, i1, i0, Q, E, m]
    return gl.convert_layout(gl.reshape(v, [128, 8]), B_OP, assert_trivial=True)


@gluon.jit
def _x_tiles(xbuf):
    """The two halves' (128, 8) B operands from a stage's x tile (8, 4, 64) [m, Q, column]."""
    xv = xbuf.load(XLOAD)
    x_h0, x_h1 = gl.split(gl.permute(gl.reshape(xv, [8, 4, 2, 32]), (0, 1, 3, 2)))
    return _x_tile(x_h0), _x_tile(x_h1)


@gluon.jit
def _k_halves_a(a):
    """The (64, 128) A operand's columns c < 64 and c >= 64 (c's bit 6 is a register bit),
    each an A operand."""
    lo, hi = gl.split(gl.permute(gl.reshape(a, [64, 2, 64]), (0, 2, 1)))
    return (gl.convert_layout(lo, A_OP, assert_trivial=True),
            gl.convert_layout(hi, A_OP, assert_trivial=True))


@gluon.jit
def _k_halves_b(b):
    """The (128, 8) B operand's rows c < 64 and c >= 64, each a B operand."""
    lo, hi = gl.split(gl.permute(gl.reshape(b, [2, 64, 8]), (1, 2, 0)))
    return (gl.convert_layout(lo, B_OP, assert_trivial=True),
            gl.convert_layout(hi, B_OP, assert_trivial=True))


@gluon.jit
def _lora_t_step(abuf, xbuf, t4):
    """t4 (4, 16, 8) += the step's A @ xᵀ, warp w summing its column slices (MMA3)."""
    av = gl.reshape(abuf.load(A_SPLIT), [RANK, 4, 2, 4, 2, 2, 2])  # [r, Q, h, w, i1, i0, E]
    av = gl.reshape(gl.permute(av, (3, 0, 4, 5, 1, 6, 2)), [4, RANK, 32, 2])  # [w, r, c', h]
    xv = gl.reshape(xbuf.load(X_SPLIT), [8, 4, 2, 4, 2, 2, 2])  # [m, Q, h, w, i1, i0, E]
    xv = gl.reshape(gl.permute(xv, (3, 4, 5, 1, 6, 0, 2)), [4, 32, 8, 2])  # [w, c', m, h]
    a0, a1 = gl.split(av)
    x0, x1 = gl.split(xv)
    t4 = mma_v2(gl.convert_layout(a0, A3_OP, assert_trivial=True),
                gl.convert_layout(x0, B3_OP, assert_trivial=True), t4)
    return mma_v2(gl.convert_layout(a1, A3_OP, assert_trivial=True),
                  gl.convert_layout(x1, B3_OP, assert_trivial=True), t4)


@gluon.jit
def _lookup_mma(words, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7, x0, x1, acc, acc1, acc2, acc3):
    """A step's words (64, 32) in WORDS2 looked up in their chunk tables (`_table`'s, (64, 4)
    each) and multiplied by x's two halves (x0, x1: `_x_tiles`) into the four accumulators."""
    w_h0, w_h1 = _word_halves(words)
    tb0 = tb0[:, :, None]
    tb1 = tb1[:, :, None]
    tb2 = tb2[:, :, None]
    tb3 = tb3[:, :, None]
    tb4 = tb4[:, :, None]
    tb5 = tb5[:, :, None]
    tb6 = tb6[:, :, None]
    tb7 = tb7[:, :, None]
    return _halves_mma(_a_tile(w_h0, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7),
                       _a_tile(w_h1, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7), x0, x1, acc, acc1,
                       acc2, acc3)


@gluon.jit
def _word_halves(words):
    """A step's words (64, 32) in WORDS2 as its two halves' (64, 4, 4) [ρ, Q, j] in HALF."""
    w3 = gl.convert_layout(gl.reshape(words, [64, 4, 8]), WORDS3, assert_trivial=True)
    w_h0, w_h1 = gl.split(gl.permute(gl.reshape(w3, [64, 4, 2, 4]), (0, 1, 3, 2)))
    return (gl.convert_layout(w_h0, HALF, assert_trivial=True),
            gl.convert_layout(w_h1, HALF, assert_trivial=True))


@gluon.jit
def _halves_mma(a0, a1, x0, x1, acc, acc1, acc2, acc3):
    """The two halves' A operands (64, 128) times x's (128, 8), each K half of each into its
    own accumulator."""
    a0l, a0h = _k_halves_a(a0)
    a1l, a1h = _k_halves_a(a1)
    b0l, b0h = _k_halves_b(x0)
    b1l, b1h = _k_halves_b(x1)
    acc = mma_v2(a0l, b0l, acc)
    acc1 = mma_v2(a0h, b0h, acc1)
    acc2 = mma_v2(a1l, b1l, acc2)
    acc3 = mma_v2(a1h, b1h, acc3)
    return acc, acc1, acc2, acc3


@gluon.jit
def _step(bufs, xbufs, abufs, ready, empty, i, scale, acc, acc1, acc2, acc3, t4,
          c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15,
          STAGES: gl.constexpr, HAS_LORA: gl.constexpr):
    """Step i of the CTA: stage i % STAGES's words, looked up at `scale` (64, 4), times x into
    the accumulators (and A times x into t4); the stage is handed back once read.

    The stage goes back after the step's MMAs, which consumed every register loaded from it:
    the producer's next TMA write (async proxy) must not overtake a load still queued in the
    shared-memory pipe, and neither a CTA barrier nor the arrive's release waits for one (no
    proxy fence is needed then: the reads are done)."""
    tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7 = _table(
        scale, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15)
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    words = bufs.index(s).load(WORDS2)
    x0, x1 = _x_tiles(xbufs.index(s))
    if HAS_LORA:
        t4 = _lora_t_step(abufs.index(s), xbufs.index(s), t4)
    acc, acc1, acc2, acc3 = _lookup_mma(words, tb0, tb1, tb2, tb3, tb4, tb5, tb6, tb7, x0, x1,
                                        acc, acc1, acc2, acc3)
    mbarrier.arrive(empty.index(s), count=1)
    return acc, acc1, acc2, acc3, t4


@gluon.jit
def _loop_start(offset_ptr, NESTED: gl.constexpr):
    """A K loop's zero sums (t4 and four accumulators) and the double-quant offset (or 0)."""
    zero = gl.zeros([64, 8], gl.float32, MMA)
    if NESTED:
        offset = gl.load(offset_ptr)
    else:
        offset = 0.0
    return gl.zeros([4, RANK, 8], gl.float32, MMA3), zero, zero, zero, zero, offset


@gluon.jit
def _scale_start(absmax_ptr, absmax2_ptr, code2_ptr, offset, row0, N, K, step_lo, nsteps,
                 BS: gl.constexpr, BS2: gl.constexpr, NESTED: gl.constexpr,
                 PAIR: gl.constexpr):
    """A K loop's scale pipeline before its first step: (its last step, the first step's
    scale, the second step's scale operands). Each step's scale comes from registers filled a
    step before: the loops load the scale operands two steps ahead and gather them into the
    scale (code2[qa]) one step ahead, so neither load's latency, nor the register moves that
    carry them to the next step, sits between a step's start and its lookups."""
    last = step_lo + nsteps - 1
    qa, a2 = _scale_operands(absmax_ptr, absmax2_ptr, row0, N, K, step_lo, BS, BS2, NESTED,
                             PAIR)
    scale = _scale(qa, a2, code2_ptr, offset, BS, NESTED, PAIR)
    qa_next, a2_next = _scale_operands(absmax_ptr, absmax2_ptr, row0, N, K,
                                       gl.minimum(step_lo + 1, last), BS, BS2, NESTED, PAIR)
    return last, scale, qa_next, a2_next


@gluon.jit
def _loop_sums(acc0, acc1, acc2, acc3, t4):
    """A K loop's result: its four accumulators summed, and t (t4 summed over the warps) in
    the epilogue's rank-sum layout."""
    return (acc0 + acc1) + (acc2 + acc3), gl.convert_layout(gl.sum(t4, axis=0),
                                                            gl.SliceLayout(0, LORA3))


@gluon.jit
def _k_loop(table, bufs, xbufs, abufs, ready, empty, code_ptr, absmax_ptr, absmax2_ptr,
            code2_ptr, offset_ptr, row0, N, K, step_lo, nsteps, i0, BS: gl.constexpr,
            BS2: gl.constexpr, NESTED: gl.constexpr, STAGES: gl.constexpr,
            HAS_LORA: gl.constexpr, PAIR_TABLE: gl.constexpr, FILL: gl.constexpr):
    """One projection's K loop over the ring's stages i0 .. i0 + nsteps - 1: (acc, t), through
    the pair table of code_ptr's code (filled first where FILL) or the register tables of
    code_ptr."""
    if PAIR_TABLE:
        return _chunk_k_loop(table, bufs, xbufs, abufs, ready, empty, code_ptr, absmax_ptr,
                             absmax2_ptr, code2_ptr, offset_ptr, row0, N, K, step_lo, nsteps,
                             i0, BS, BS2, NESTED, STAGES, HAS_LORA, FILL)
    else:
        return _table_k_loop(bufs, xbufs, abufs, ready, empty, code_ptr, absmax_ptr,
                             absmax2_ptr, code2_ptr, offset_ptr, row0, N, K, step_lo, nsteps,
                             i0, BS, BS2, NESTED, STAGES, HAS_LORA)


@gluon.jit
def _table_k_loop(bufs, xbufs, abufs, ready, empty, code_ptr, absmax_ptr, absmax2_ptr,
                  code2_ptr, offset_ptr, row0, N, K, step_lo, nsteps, i0, BS: gl.constexpr,
                  BS2: gl.constexpr, NESTED: gl.constexpr, STAGES: gl.constexpr,
                  HAS_LORA: gl.constexpr):
    """`_k_loop` through the register tables (`_step`)."""
    t4, acc, acc1, acc2, acc3, offset = _loop_start(offset_ptr, NESTED)
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = _codes(code_ptr)
    last, scale, qa_next, a2_next = _scale_start(absmax_ptr, absmax2_ptr, code2_ptr, offset,
                                                 row0, N, K, step_lo, nsteps, BS, BS2, NESTED,
                                                 False)
    for i in range(nsteps):
        step = step_lo + i
        qa_after, a2_after = _scale_operands(absmax_ptr, absmax2_ptr, row0, N, K,
                                             gl.minimum(step + 2, last), BS, BS2, NESTED,
                                             False)
        scale_next = _scale(qa_next, a2_next, code2_ptr, offset, BS, NESTED, False)
        acc, acc1, acc2, acc3, t4 = _step(
            bufs, xbufs, abufs, ready, empty, i0 + i, scale, acc, acc1, acc2, acc3, t4,
            c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, STAGES,
            HAS_LORA)
        scale = scale_next
        qa_next, a2_next = qa_after, a2_after
    return _loop_sums(acc, acc1, acc2, acc3, t4)


@gluon.jit
def _stage_row(r):
    """The stage row ρ = 32·rb + 8·w + l // 4 of MMA row r = 16·w + 8·rb + l // 4."""
    return 32 * ((r >> 3) & 1) + 8 * (r >> 4) + (r & 7)


@gluon.jit
def _chunk_k_loop(table, bufs, xbufs, abufs, ready, empty, code_ptr, absmax_ptr, absmax2_ptr,
                  code2_ptr, offset_ptr, row0, N, K, step_lo, nsteps, i0, BS: gl.constexpr,
                  BS2: gl.constexpr, NESTED: gl.constexpr, STAGES: gl.constexpr,
                  HAS_LORA: gl.constexpr, FILL: gl.constexpr):
    """`_k_loop` through the pair table (`_chunk_step`): (acc, t), acc by MMA row; the stage
    goes back as `_step` says. With FILL the consumer warps fill the table first, after the
    first step's scale loads are issued, so that those loads' latency (the scale is two
    dependent loads: its code index, then code2 at it) and the fill's overlap; the barrier is
    the consumer warps' own (the producer's first copies are not held behind the fill)."""
    t4, acc0, acc1, acc2, acc3, offset = _loop_start(offset_ptr, NESTED)
    base = _pair_table_base(gl.zeros([64, 2, 4], gl.int32, WORDS_Q))
    last, scale, qa_next, a2_next = _scale_start(absmax_ptr, absmax2_ptr, code2_ptr, offset,
                                                 row0, N, K, step_lo, nsteps, BS, BS2, NESTED,
                                                 True)
    if FILL:
        _fill_pair_table(table, code_ptr)
        cta_barrier()
    for i in range(nsteps):
        step = step_lo + i
        scale_next = _scale(qa_next, a2_next, code2_ptr, offset, BS, NESTED, True)
        s = (i0 + i) % STAGES
        mbarrier.wait(ready.index(s), ((i0 + i) // STAGES) & 1)
        words = bufs.index(s).load(WORDS_C)
        xv = xbufs.index(s).load(XLOAD_C)
        if HAS_LORA:
            t4 = _lora_t_step(abufs.index(s), xbufs.index(s), t4)
        qa_after, a2_after = _scale_operands(absmax_ptr, absmax2_ptr, row0, N, K,
                                             gl.minimum(step + 2, last), BS, BS2, NESTED, True)
        acc0, acc1, acc2, acc3 = _chunk_step(words, xv, base, scale, acc0, acc1, acc2, acc3)
        mbarrier.arrive(empty.index(s), count=1)  # as `_step`: after the MMAs
        scale = scale_next
        qa_next, a2_next = qa_after, a2_after
    return _loop_sums(acc0, acc1, acc2, acc3, t4)


@gluon.jit
def _pick(seg, v0, v1, v2):
    """v0, v1 or v2 by the segment index (a uniform branch)."""
    r = v0
    if seg == 1:
        r = v1
    if seg == 2:
        r = v2
    return r


@gluon.jit
def _consumer(table, bufs, xbufs, abufs, ready, empty, seg,
              code_ptr0, absmax_ptr0, absmax2_ptr0, code2_ptr0, offset_ptr0, n0, b_ptr0,
              stride_bn0,
              code_ptr1, absmax_ptr1, absmax2_ptr1, code2_ptr1, offset_ptr1, n1, b_ptr1,
              stride_bn1,
              code_ptr2, absmax_ptr2, absmax2_ptr2, code2_ptr2, offset_ptr2, n2, b_ptr2,
              stride_bn2,
              row0, K, M, step_lo, nsteps, t_ptr, stride_tp, stride_tr, pid_k,
              BS: gl.constexpr, BS2: gl.constexpr, NESTED: gl.constexpr,
              STAGES: gl.constexpr, HAS_LORA: gl.constexpr, GLU: gl.constexpr,
              PAIR_TABLE: gl.constexpr, T_PARTS: gl.constexpr):
    """(acc, t, B's tile) of the CTA's segment; with GLU the gate's (segment 0), then the up
    projection's (segment 1) from the next stages; the lookup by PAIR_TABLE (`_k_loop`; the
    first K loop fills the pair table, the launch's projections share one code). B's tiles
    are loaded before their K loops, so the epilogue does not wait for them (the up
    projection's after the gate's loop: one tile's registers live through each loop).
    T_PARTS > 0: t is given (`_given_t`), and the K loops run no LoRA work."""
    LOOP_LORA: gl.constexpr = HAS_LORA and T_PARTS == 0
    if GLU:
        b = _lora_b(b_ptr0, row0, n0, stride_bn0, HAS_LORA)
        acc, t = _k_loop(table, bufs, xbufs, abufs, ready, empty, code_ptr0, absmax_ptr0,
                         absmax2_ptr0, code2_ptr0, offset_ptr0, row0, n0, K, step_lo, nsteps,
                         0, BS, BS2, NESTED, STAGES, LOOP_LORA, PAIR_TABLE, True)
        b_u = _lora_b(b_ptr1, row0, n0, stride_bn1, HAS_LORA)
        acc_u, t_u = _k_loop(table, bufs, xbufs, abufs, ready, empty, code_ptr1, absmax_ptr1,
                             absmax2_ptr1, code2_ptr1, offset_ptr1, row0, n0, K, step_lo,
                             nsteps, nsteps, BS, BS2, NESTED, STAGES, LOOP_LORA, PAIR_TABLE,
                             False)
    else:
        b = _lora_b(_pick(seg, b_ptr0, b_ptr1, b_ptr2), row0, _pick(seg, n0, n1, n2),
                    _pick(seg, stride_bn0, stride_bn1, stride_bn2), HAS_LORA)
        b_u = b
        acc, t = _k_loop(table, bufs, xbufs, abufs, ready, empty,
                         _pick(seg, code_ptr0, code_ptr1, code_ptr2),
                         _pick(seg, absmax_ptr0, absmax_ptr1, absmax_ptr2),
                         _pick(seg, absmax2_ptr0, absmax2_ptr1, absmax2_ptr2),
                         _pick(seg, code2_ptr0, code2_ptr1, code2_ptr2),
                         _pick(seg, offset_ptr0, offset_ptr1, offset_ptr2), row0,
                         _pick(seg, n0, n1, n2), K, step_lo, nsteps, 0, BS, BS2, NESTED,
                         STAGES, LOOP_LORA, PAIR_TABLE, True)
        acc_u, t_u = acc, t
    if HAS_LORA and T_PARTS > 0:
        t = _given_t(t_ptr, stride_tp, stride_tr, 0 if GLU else seg, M, pid_k, T_PARTS)
        t_u = t
        if GLU:
            t_u = _given_t(t_ptr, stride_tp, stride_tr, 1, M, pid_k, T_PARTS)
    return acc, t, b, acc_u, t_u, b_u


@gluon.jit
def _given_t(t_ptr, stride_tp, stride_tr, j, M, pid_k, T_PARTS: gl.constexpr):
    """t (16, 8) fp32 of projection j in the rank-sum layout from the parts T (`lora_t`):
    Σ_p T[p, 16·j + r, m] from zero in part order, rows m < M (the rest 0), each element
    summed by one thread (T_GIVEN) and then spread to the layout. Only split 0 adds the LoRA
    term (t is over all of K): the others' t is 0. Read after the K loops, whose stages'
    x the producer copied after its grid wait (griddepcontrol.wait makes the previous grid's
    writes, t's among them, visible to this whole grid)."""
    r = gl.arange(0, RANK, layout=gl.SliceLayout(1, T_GIVEN))
    m = gl.arange(0, 8, layout=gl.SliceLayout(0, T_GIVEN))
    ptrs = t_ptr + (j * RANK + r[:, None]) * stride_tr + m[None, :]
    mask = (r < RANK)[:, None] & (m < M)[None, :] & (pid_k == 0)
    t = gl.zeros([RANK, 8], gl.float32, T_GIVEN)
    for p in gl.static_range(T_PARTS):  # every load issued before the first add needs it
        t += gl.load(ptrs + p * stride_tp, mask=mask, other=0.0)
    return gl.convert_layout(t, gl.SliceLayout(0, LORA3))


@gluon.jit
def _grid_wait(PDL: gl.constexpr):
    """Wait until the previous kernel in the stream has completed and its writes are visible
    (griddepcontrol.wait; `pdl.grid_wait` for a Gluon kernel)."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _load_weights(seg, w_desc0, a_desc0, w_desc1, a_desc1, w_desc2, a_desc2, row0, step, bar,
                  wbuf, abuf, HAS_LORA: gl.constexpr):
    """The TMA copies of segment seg's packed weight (and A) of `step` into a stage."""
    if seg == 0:
        tma_load(w_desc0, [row0, step * STEP_WORDS], bar, wbuf)
        if HAS_LORA:
            tma_load(a_desc0, [0, step * 4, 0], bar, abuf)
    elif seg == 1:
        tma_load(w_desc1, [row0, step * STEP_WORDS], bar, wbuf)
        if HAS_LORA:
            tma_load(a_desc1, [0, step * 4, 0], bar, abuf)
    else:
        tma_load(w_desc2, [row0, step * STEP_WORDS], bar, wbuf)
        if HAS_LORA:
            tma_load(a_desc2, [0, step * 4, 0], bar, abuf)


@gluon.jit
def _producer(x_desc, w_desc0, a_desc0, w_desc1, a_desc1, w_desc2, a_desc2, bufs, xbufs, abufs,
              ready, empty, seg, row0, step_lo, nsteps, STAGES: gl.constexpr,
              HAS_LORA: gl.constexpr, GLU: gl.constexpr, PDL: gl.constexpr):
    """The stages' copies: the segment's steps (with GLU the gate's, then the up
    projection's). The first STAGES stages' weights are copied before `_grid_wait`: only x
    comes from the kernel before this one."""
    nbytes: gl.constexpr = (w_desc0.block_type.nbytes + x_desc.block_type.nbytes
                            + (a_desc0.block_type.nbytes if HAS_LORA else 0))
    total = nsteps * (2 if GLU else 1)
    for i in gl.static_range(STAGES):
        if i < total:
            mbarrier.expect(ready.index(i), nbytes)
            _load_weights(seg + (i >= nsteps).to(gl.int32), w_desc0, a_desc0, w_desc1,
                          a_desc1, w_desc2, a_desc2, row0, step_lo + i % nsteps,
                          ready.index(i), bufs.index(i), abufs.index(i), HAS_LORA)
    _grid_wait(PDL)
    for i in gl.static_range(STAGES):
        if i < total:
            tma_load(x_desc, [0, (step_lo + i % nsteps) * 4, 0], ready.index(i),
                     xbufs.index(i))
    for i in range(STAGES, total):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        step = step_lo + i % nsteps
        _load_weights(seg + (i >= nsteps).to(gl.int32), w_desc0, a_desc0, w_desc1, a_desc1,
                      w_desc2, a_desc2, row0, step, ready.index(s), bufs.index(s),
                      abufs.index(s), HAS_LORA)
        tma_load(x_desc, [0, step * 4, 0], ready.index(s), xbufs.index(s))


@gluon.jit
def _lora_b(b_ptr, row0, N, stride_bn, HAS_LORA: gl.constexpr):
    """B[tile] (64, 16) bf16 in the rank-sum layout, rows in stage order (rows past N: 0);
    zeros without LoRA (nothing reads them then)."""
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, LORA3)))
    j = gl.arange(0, RANK, layout=gl.SliceLayout(0, gl.SliceLayout(2, LORA3)))
    if HAS_LORA:
        n = row0 + _stage_row(r)
        return gl.load(b_ptr + n[:, None] * stride_bn + j[None, :],
                       mask=(n < N)[:, None] & (j < RANK)[None, :], other=0.0)
    else:
        return gl.zeros([64, RANK], gl.bfloat16, gl.SliceLayout(2, LORA3))


@gluon.jit
def _lora_term(t3, b, scaling):
    """s · B[tile] @ t, (64, 8) fp32 in the accumulator's layout, rows in stage order, from B's
    tile b (`_lora_b`) and t (16, 8) in the rank-sum layout."""
    lora = gl.sum(b.to(gl.float32)[:, :, None] * t3[None, :, :], axis=1)
    return gl.convert_layout(lora * scaling, MMA)


@gluon.jit
def _silu_mul(g, u):
    """round(silu(round(g)) · round(u)) from the fp32 sums: `linear4bit._silu_mul`'s roundings
    (torch's F.silu(gate) * up on the rounded projections: libdevice's expf, an IEEE
    division, the product of two bf16 exact in fp32)."""
    g = g.to(gl.bfloat16).to(gl.float32)
    u = u.to(gl.bfloat16).to(gl.float32)
    e = libdevice.exp(-g)
    s = gl.div_rn(g, 1.0 + e).to(gl.bfloat16).to(gl.float32)
    return (s * u).to(gl.bfloat16)


@gluon.jit
def linear4bit_ws_kernel(x_desc, y_ptr, part_ptr, t_ptr, stride_tp, stride_tr,
                         w_desc0, a_desc0, b_ptr0, code_ptr0, absmax_ptr0, absmax2_ptr0,
                         code2_ptr0, offset_ptr0, scaling0, stride_bn0, n0, bias_ptr0,
                         w_desc1, a_desc1, b_ptr1, code_ptr1, absmax_ptr1, absmax2_ptr1,
                         code2_ptr1, offset_ptr1, scaling1, stride_bn1, n1, bias_ptr1,
                         w_desc2, a_desc2, b_ptr2, code_ptr2, absmax_ptr2, absmax2_ptr2,
                         code2_ptr2, offset_ptr2, scaling2, stride_bn2, n2, bias_ptr2,
                         tile1, tile2, col1, col2, K, M, stride_ym, stride_pm, stride_ps,
                         steps_per_split, BS: gl.constexpr, BS2: gl.constexpr,
                         NESTED: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
                         HAS_LORA: gl.constexpr, HAS_BIAS: gl.constexpr, GLU: gl.constexpr,
                         PDL: gl.constexpr,
                         EARLY_NEXT: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                         PAIR_TABLE: gl.constexpr, T_PARTS: gl.constexpr):
    """Grid (Σ_s N_s / 64 tiles, K splits): the arguments ending in s are projection s's
    (segment s, its tiles from tile_s, its output columns from col_s; segments past the
    launch's repeat the last, and tile_s is then past the grid). y (M, Σ N_s) in bf16, or with
    SPLIT the split's fp32 partial part[split] (M, Σ N_s) (row stride stride_pm). GLU (one
    split, segments 0 and 1 of one N): a CTA streams the gate's rows of its tile, then the up
    projection's, and y = silu(gate) · up. HAS_BIAS: bias_ptr_s is projection s's bias, added
    in fp32 before the one rounding (GLU: to each of gate and up), and left out of SPLIT
    partials (their sum adds it). PDL: launched with programmatic dependent launch (`pdl`);
    the producer waits for the previous kernel before it copies x. T_PARTS > 0: LoRA's t as
    `lora_t`'s T_PARTS parts at t_ptr (part stride stride_tp, a rank's stride_tr, rows unit).
    `linear4bit_ws.launch` gives the descriptors and the steps a split."""
    pid = gl.program_id(0)
    seg = (pid >= tile1).to(gl.int32) + (pid >= tile2).to(gl.int32)
    row0 = (pid - (seg == 1).to(gl.int32) * tile1 - (seg == 2).to(gl.int32) * tile2) * ROWS
    pid_k = gl.program_id(1)
    step_lo = pid_k * steps_per_split
    nsteps = gl.minimum(steps_per_split, K // 256 - step_lo)
    # the pair table first, so that it sits at the start of shared memory (its lookups address
    # it from there: `_pair_table_base`); the consumer fills it (`_chunk_k_loop`). Without the
    # table, a one-row stand-in that nothing reads.
    table = gl.allocate_shared_memory(gl.int32, [256 if PAIR_TABLE else 1, 32],
                                      PAIR_TABLE_LAYOUT)
    bufs = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, STEP_WORDS], w_desc0.layout)
    xbufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 8, 4, 64], x_desc.layout)
    LOOP_LORA: gl.constexpr = HAS_LORA and T_PARTS == 0  # A streamed beside the weight
    abufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES if LOOP_LORA else 1, RANK, 4, 64],
                                      a_desc0.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    acc, t, b, acc_u, t_u, b_u = gl.warp_specialize([
        (_consumer, (table, bufs, xbufs, abufs, ready, empty, seg,
                     code_ptr0, absmax_ptr0, absmax2_ptr0, code2_ptr0, offset_ptr0, n0,
                     b_ptr0, stride_bn0,
                     code_ptr1, absmax_ptr1, absmax2_ptr1, code2_ptr1, offset_ptr1, n1,
                     b_ptr1, stride_bn1,
                     code_ptr2, absmax_ptr2, absmax2_ptr2, code2_ptr2, offset_ptr2, n2,
                     b_ptr2, stride_bn2,
                     row0, K, M, step_lo, nsteps, t_ptr, stride_tp, stride_tr, pid_k, BS, BS2,
                     NESTED, STAGES, HAS_LORA, GLU, PAIR_TABLE, T_PARTS)),
        (_producer, (x_desc, w_desc0, a_desc0, w_desc1, a_desc1, w_desc2, a_desc2, bufs,
                     xbufs, abufs, ready, empty, seg, row0, step_lo, nsteps, STAGES, LOOP_LORA,
                     GLU, PDL)),
    ], [1], [PRODUCER_REGS])
    if PAIR_TABLE:  # the table's last use as the compiler sees it (its lookups are inline
        table._keep_alive()  # PTX): its bytes stay the table's through the K loops
    if EARLY_NEXT:  # the next kernel may start now (its programs wait in their grid_wait)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)
    if GLU:
        n = n0
        col = 0
    else:
        n = _pick(seg, n0, n1, n2)
        col = (seg == 1).to(gl.int32) * col1 + (seg == 2).to(gl.int32) * col2
    if HAS_LORA:
        if GLU:
            acc += _lora_term(t, b, scaling0)
            acc_u += _lora_term(t_u, b_u, scaling1)
        else:
            acc += _lora_term(t, b, _pick(seg, scaling0, scaling1, scaling2))
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    m = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    nr = row0 + _stage_row(r)
    mask = (nr < n)[:, None] & (m < M)[None, :]
    if HAS_BIAS and not SPLIT:  # a split's partials go without it: their sum adds it
        if GLU:
            acc += gl.load(bias_ptr0 + nr, mask=nr < n, other=0.0).to(gl.float32)[:, None]
            acc_u += gl.load(bias_ptr1 + nr, mask=nr < n, other=0.0).to(gl.float32)[:, None]
        else:
            acc += gl.load(_pick(seg, bias_ptr0, bias_ptr1, bias_ptr2) + nr, mask=nr < n,
                           other=0.0).to(gl.float32)[:, None]
    if GLU:
        gl.store(y_ptr + m[None, :] * stride_ym + nr[:, None], _silu_mul(acc, acc_u),
                 mask=mask)
    elif SPLIT:
        gl.store(part_ptr + pid_k * stride_ps + m[None, :] * stride_pm + (col + nr)[:, None],
                 acc, mask=mask)
    else:
        gl.store(y_ptr + m[None, :] * stride_ym + (col + nr)[:, None], acc.to(gl.bfloat16),
                 mask=mask)
