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
(the same bits as a second reduction launch, which `LAST_REDUCES=False` keeps). Each split
carries its own LoRA term s · t_split @ Bᵀ, t_split = x[:, split] @ A[:, split]ᵀ: the term is
linear in t, so the splits add up to s · t @ Bᵀ, and every sum stays fp32 (no chain longer than
K + r + SPLIT_K terms).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from ..kernels._interp import dot, interpreting, to_dtype


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


# PTX, two packed bytes at a time ($2, a 16-bit register; pack=2: the compiler may hold the
# tile in the MMA operand layout, where a thread's consecutive elements are pairs along K of one
# row, and the table operands are that row's). Each byte's two nibbles are looked up in the
# byte-plane table ($3 + 2j: low-byte word j, $11 + 2j: high-byte word j; the first of each
# operand's two copies). prmt picks 4 bytes out of 8 by 3-bit selectors: the 4 nibbles select
# in entries 0-7 and in 8-15 (bit 3 cleared: it is prmt's sign-replicate flag), then each
# nibble's bit 3 picks between the two. Out: $0 the high nibbles' values (even elements) of
# bytes 0 and 1, two 16-bit floats, byte 0's in the lower half; $1 the low nibbles' (odd).
_DEQUANT_ASM = """{
.reg .b32 w, s, m, a, b, l, h;
cvt.u32.u16 w, $2;
and.b32 s, w, 0x7777;
shr.u32 m, w, 1;
and.b32 m, m, 0x4444;
or.b32 m, m, 0x3210;
prmt.b32 a, $3, $5, s;
prmt.b32 b, $7, $9, s;
prmt.b32 l, a, b, m;
prmt.b32 a, $11, $13, s;
prmt.b32 b, $15, $17, s;
prmt.b32 h, a, b, m;
prmt.b32 $0, l, h, 0x7351;
prmt.b32 $1, l, h, 0x6240;
}"""
_TABLE_BF16 = tl.constexpr(_table_asm("cvt.rn.bf16x2.f32"))
_TABLE_F16 = tl.constexpr(_table_asm("cvt.rn.f16x2.f32"))
_TABLE_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 17))
_DEQUANT = tl.constexpr(_DEQUANT_ASM)
_DEQUANT_CONSTRAINTS = tl.constexpr(",".join(["=r", "=r", "h"] + ["r"] * 16))


@triton.jit
def _dequant_prmt(p, scale, code_ptr, dtype: tl.constexpr):
    """(high nibbles, low nibbles) of the packed bytes p (BLOCK_N, HB) uint8 as
    round(code[q] · scale[n]) in dtype, each (BLOCK_N, HB): one table of 16 values per row,
    then register byte permutes (no memory lookups per element)."""
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
    lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3 = tl.inline_asm_elementwise(
        table_asm, _TABLE_CONSTRAINTS,
        [scale, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32,
               tl.int32), is_pure=True, pack=1)
    args = [p, lo0[:, None], lo1[:, None], lo2[:, None], lo3[:, None],
            hi0[:, None], hi1[:, None], hi2[:, None], hi3[:, None]]
    if dtype == tl.bfloat16:
        w_hi, w_lo = tl.inline_asm_elementwise(_DEQUANT, _DEQUANT_CONSTRAINTS, args,
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                               pack=2)
    else:
        w_hi, w_lo = tl.inline_asm_elementwise(_DEQUANT, _DEQUANT_CONSTRAINTS, args,
                                               dtype=(tl.float16, tl.float16), is_pure=True,
                                               pack=2)
    return w_hi, w_lo


@triton.jit
def _sum_splits(acc, part_ptr, offs, mask, splits, stride_ps):
    """acc (zeros) + part[0] + part[1] + ... in split order, fp32: both split-K reductions sum
    this way, so they give the same bits. Read from L2 (.cg): other programs wrote the parts."""
    for s in range(splits):
        acc += tl.load(part_ptr + s * stride_ps + offs, mask=mask, other=0.0,
                       cache_modifier=".cg")
    return acc


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
def _block_bytes_and_scale(w_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset, ablk, offs_j, n_ok,
                           HB: tl.constexpr, BS2: tl.constexpr, NESTED: tl.constexpr):
    """The packed bytes (BLOCK_N, HB) and the fp32 scale (BLOCK_N,) of absmax block `ablk` of
    each row (ablk (BLOCK_N,) int64, the flat block index)."""
    if NESTED:
        qa = tl.load(absmax_ptr + ablk, mask=n_ok, other=0)
        scale = tl.load(code2_ptr + qa.to(tl.int32)) * tl.load(
            absmax2_ptr + ablk // BS2, mask=n_ok, other=0.0) + offset
    else:
        scale = tl.load(absmax_ptr + ablk, mask=n_ok, other=0.0)
    # contiguous per row: the only traffic that scales with N·K
    p = tl.load(w_ptr + (ablk * HB)[:, None] + offs_j[None, :], mask=n_ok[:, None], other=0)
    return p, scale


@triton.jit
def _linear4bit_lora_kernel(
    x_ptr, w_ptr, code_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr,
    a_ptr, b_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, R, BLOCKS_PER_SPLIT, scaling,
    stride_xm, stride_ar, stride_bn, stride_ym, stride_ps, stride_pm,
    BS: tl.constexpr, BS2: tl.constexpr, NESTED: tl.constexpr,
    HAS_LORA: tl.constexpr, LORA_FP32: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr, LAST_REDUCES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    PRMT: tl.constexpr, PREFETCH: tl.constexpr, INTERP: tl.constexpr,
):
    """One launch per projection (two with LAST_REDUCES off). The output tile is held
    transposed, accT (BLOCK_N, BLOCK_M) = y[m-block, n-block]ᵀ, so that the dequantized weight
    tile is the left operand of the dot: the compiler then moves it into the MMA's operand
    layout with far fewer shared-memory loads than as the right operand (half the instructions
    per weight element; bench/README.md, the decode linear). Over this program's K slice, one
    absmax block of BS elements per iteration, so the block's scale is one value per row n:

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
    rounded weight bit for bit. PREFETCH loads the next block's bytes and scales before this
    block's math, so their latency hides behind it.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    HB: tl.constexpr = BS // 2  # packed bytes per row per absmax block
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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
    blk_lo = pid_k * BLOCKS_PER_SPLIT
    blk_hi = tl.minimum(blk_lo + BLOCKS_PER_SPLIT, KB)
    if PREFETCH:
        p_next, scale_next = _block_bytes_and_scale(
            w_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset, n_blk + blk_lo, offs_j, n_ok,
            HB, BS2, NESTED)
    for blk in range(blk_lo, blk_hi):
        if PREFETCH:  # this block's loads were issued an iteration ago; issue the next's now
            p, scale = p_next, scale_next
            p_next, scale_next = _block_bytes_and_scale(
                w_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset,
                n_blk + tl.minimum(blk + 1, blk_hi - 1), offs_j, n_ok, HB, BS2, NESTED)
        else:
            p, scale = _block_bytes_and_scale(w_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset,
                                              n_blk + blk, offs_j, n_ok, HB, BS2, NESTED)
        # code · scale in fp32, rounded to x's dtype: bitsandbytes' dequantized weight
        if PRMT:
            w_hi, w_lo = _dequant_prmt(p, scale, code_ptr, x_ptr.dtype.element_ty)
        else:
            c_hi = tl.load(code_ptr + (p >> 4).to(tl.int32))
            c_lo = tl.load(code_ptr + (p & 15).to(tl.int32))
            w_hi = to_dtype(c_hi * scale[:, None], x_ptr.dtype.element_ty, INTERP)
            w_lo = to_dtype(c_lo * scale[:, None], x_ptr.dtype.element_ty, INTERP)
        k_blk = blk * BS + offs_k  # (BS,) K % BS == 0: no column mask
        # x's block loaded contiguously, then split into its even and odd columns in registers
        x_even, x_odd = tl.split(tl.reshape(tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k_blk[None, :], mask=m_ok[:, None], other=0.0),
            (BLOCK_M, HB, 2)))
        acc += dot(w_hi, tl.trans(x_even), INTERP)
        acc += dot(w_lo, tl.trans(x_odd), INTERP)
        if HAS_LORA:
            a_even, a_odd = tl.split(tl.reshape(tl.load(
                a_ptr + offs_r[:, None] * stride_ar + k_blk[None, :], mask=r_ok[:, None],
                other=0.0), (BLOCK_R, HB, 2)))
            if LORA_FP32:  # A is not x's dtype: PEFT casts x to A's dtype; fp32 products
                t += tl.dot(x_even.to(tl.float32), tl.trans(a_even.to(tl.float32)),
                            input_precision="ieee")
                t += tl.dot(x_odd.to(tl.float32), tl.trans(a_odd.to(tl.float32)),
                            input_precision="ieee")
            else:  # 16-bit products are exact in fp32: the same t as an fp32 dot
                t += dot(x_even, tl.trans(a_even), INTERP)
                t += dot(x_odd, tl.trans(a_odd), INTERP)
    if HAS_LORA:
        b = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_r[None, :],
                    mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        acc += scaling * tl.dot(b.to(tl.float32), tl.trans(t), input_precision="ieee")
    mask = n_ok[:, None] & m_ok[None, :]
    part_offs = offs_m[None, :] * stride_pm + offs_n[:, None]
    if SPLIT:
        tl.store(part_ptr + pid_k * stride_ps + part_offs, acc, mask=mask)
        if LAST_REDUCES:
            # The tile's last split to arrive sums all splits' partials (`_sum_splits`, as the
            # separate reduction does) and resets the tile's counter to zero for the next call.
            # Every thread's partial is stored before the counter's release; the last program
            # reads the others' partials after its acquire.
            tl.debug_barrier()
            splits = tl.num_programs(2)
            tile = pid_m * tl.num_programs(1) + pid_n
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == splits - 1:
                acc = _sum_splits(tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), part_ptr,
                                  part_offs, mask, splits, stride_ps)
                if HAS_BIAS:
                    acc += tl.load(bias_ptr + offs_n, mask=n_ok,
                                   other=0.0).to(tl.float32)[:, None]
                tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None],
                         to_dtype(acc, y_ptr.dtype.element_ty, INTERP), mask=mask)
                tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None],
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
        common = {"packed": packed, "code": qs.code.float(), "blocksize": bs, "shape": (n, k)}
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


def pick_config(m: int, n: int, k: int, blocksize: int, num_sms: int) -> dict:
    """Tiles: BLOCK_M covers the decode batch (16 is the smallest dot tile); BLOCK_N 64 output
    columns for N ≤ 1024, 128 above, on 4 warps. The K loop (one absmax block per step) is
    split over programs so that the grid holds about two programs per SM (the largest power of
    two that does not pass it) and no program runs more than 16 steps, but every program at
    least four (below that, the partial sums' traffic and the reduction cost more than the
    parallelism brings); at most 32 splits. Each step's packed bytes and scales are loaded one
    step ahead (PREFETCH), in registers: one stage. (bench/README.md, the decode linear: the
    rule against the sweep of every tile.)"""
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n = 64 if n <= 1024 else 128
    blocks = k // blocksize
    mn_progs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    by_sms = max(1, 2 * num_sms // mn_progs)
    by_sms = 1 << (by_sms.bit_length() - 1)  # largest power of two <= 2·SMs / programs
    by_steps = triton.next_power_of_2(triton.cdiv(blocks, 16))
    split = max(1, min(max(by_sms, by_steps), 32, blocks // 4))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "SPLIT_K": split, "num_warps": 4,
            "num_stages": 1, "PREFETCH": True}


def split_steps(blocks: int, split: int) -> tuple[int, int]:
    """(absmax blocks per program, programs along K) for `split` programs asked over `blocks`
    blocks: every program gets the same number of steps but the last, and none gets none."""
    per = triton.cdiv(blocks, split)
    return per, triton.cdiv(blocks, per)


_COUNTERS: dict = {}  # device -> int32 tile counters, zero between calls
_RETIRED: list = []  # outgrown counter buffers: captured graphs may still point at them


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """Zeroed int32 arrival counters for `tiles` output tiles, kept per device (each call's last
    split per tile resets its counter, so they stay zero between calls). None while a CUDA graph
    is being captured and no large enough buffer exists yet (allocating it then would tie it to
    the graph's memory pool): the call then reduces in a second launch. Calls on one device
    share the buffer, so they must not overlap in time: one stream, as the decode step runs."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def linear4bit_lora(x: torch.Tensor, w: Packed4bit, *, bias: torch.Tensor | None = None,
                    lora_a: torch.Tensor | None = None, lora_b: torch.Tensor | None = None,
                    scaling: float = 1.0, config: dict | None = None) -> torch.Tensor:
    """y (M, N) in x's dtype = x @ round(W)ᵀ + bias + scaling · (x @ lora_aᵀ) @ lora_bᵀ
    (module docstring for the bound). x (M, K) bf16/fp16; lora_a (r, K), lora_b (N, r) any
    float dtype, read at this call. `config`: BLOCK_M, BLOCK_N, SPLIT_K and optionally
    num_warps, num_stages (default `pick_config`), PRMT (default: on the GPU; the code table
    looked up by register byte permutes, else by memory gathers, the same values), PREFETCH,
    LAST_REDUCES (default True: with split K, each tile's last split sums the partials in the
    same launch; False: a second launch does)."""
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected (M, {k}) for weight {(n, k)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x has dtype {x.dtype}, expected bfloat16 or float16")
    if (lora_a is None) != (lora_b is None):
        raise ValueError("lora_a and lora_b come together")
    x = x if x.stride(1) == 1 else x.contiguous()
    m = x.shape[0]
    has_lora = lora_a is not None
    r = 0
    if has_lora:
        r = lora_a.shape[0]
        if lora_a.shape != (r, k) or lora_b.shape != (n, r):
            raise ValueError(f"lora_a {tuple(lora_a.shape)} and lora_b {tuple(lora_b.shape)} "
                             f"do not fit (r, K={k}) and (N={n}, r)")
        lora_a = lora_a if lora_a.stride(1) == 1 else lora_a.contiguous()
        lora_b = lora_b if lora_b.stride(1) == 1 else lora_b.contiguous()
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({n},)")
    cfg = config or pick_config(m, n, k, w.blocksize, _num_sms(x.device))
    interp = interpreting()
    prmt = cfg.get("PRMT", not interp)
    if prmt and interp:
        raise ValueError("config PRMT=True (the code looked up by PTX byte permutes) needs the "
                         "GPU compiler; Triton's interpreter runs PRMT=False")
    per, split_k = split_steps(k // w.blocksize, cfg["SPLIT_K"])
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)  # (M, N)
    part = (torch.empty(split_k, m, n, device=x.device, dtype=torch.float32)  # (SPLIT_K, M, N)
            if split_k > 1 else y)
    bias_arg = bias if bias is not None else y
    a_arg, b_arg = (lora_a, lora_b) if has_lora else (x, x)  # placeholders, never read
    nested = w.nested
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split_k)
    counts = (_tile_counters(x.device, grid[0] * grid[1])
              if split_k > 1 and cfg.get("LAST_REDUCES", True) else None)
    _linear4bit_lora_kernel[grid](
        x, w.packed, w.code, w.absmax,
        w.code2 if nested else w.code, w.absmax2 if nested else w.code,
        w.offset if nested else w.code,
        a_arg, b_arg, bias_arg, y, part, counts if counts is not None else y,
        m, n, k, r, per, float(scaling),
        x.stride(0), a_arg.stride(0), b_arg.stride(0), y.stride(0),
        part.stride(0) if split_k > 1 else 0, part.stride(1) if split_k > 1 else 0,
        BS=w.blocksize, BS2=w.blocksize2, NESTED=nested, HAS_LORA=has_lora,
        LORA_FP32=has_lora and lora_a.dtype != x.dtype, HAS_BIAS=bias is not None,
        SPLIT=split_k > 1, LAST_REDUCES=counts is not None, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_R=max(16, triton.next_power_of_2(r)), PRMT=prmt,
        PREFETCH=cfg.get("PREFETCH", False),
        INTERP=interp,
        # no FMA contraction: the double-quant scale code2·absmax2 + offset is then formed with
        # the same two roundings as bitsandbytes' (a product, then an add)
        enable_fp_fusion=False, num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 1),
    )
    if split_k > 1 and counts is None:
        bm, bn = cfg["BLOCK_M"], 64
        _split_k_reduce_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            part, bias_arg, y, m, n, split_k, part.stride(0), part.stride(1), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, INTERP=interp)
    return y


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


def decode_linear(x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """module(x) for x (..., K), in eval-mode semantics, through the fused 4-bit + LoRA kernel:

    - bitsandbytes `Linear4bit` (x cast to its compute_dtype, the result back to x's dtype),
    - PEFT `lora.Linear4bit` / `lora.Linear` with one active adapter (dropout is the identity:
      eval mode, or p = 0), scaling read from the layer,
    - torch.nn.Linear (+ LoRA): cuBLAS GEMMs in PEFT's order, no kernel of ours.

    Reads every weight, LoRA factor and scale from the module's storage at this call. No
    autograd (the output has no grad_fn): this is the sampler's forward.
    Raises UnsupportedLinear (a ValueError) with the reason for anything else.
    """
    res = _resolve_lora(module)
    base = res.base
    if _is_linear4bit(base):
        w = _packed_weight(base)
        cd = base.compute_dtype or x.dtype
        if cd not in (torch.bfloat16, torch.float16):
            raise UnsupportedLinear(f"Linear4bit compute dtype is {cd}, the kernel takes "
                                    "bfloat16 or float16")
        if base.weight.device != x.device:
            raise ValueError(f"x is on {x.device} but the weight is on {base.weight.device}")
        x2 = x.reshape(-1, x.shape[-1]).to(cd)  # (M, K)
        bias = None if base.bias is None else base.bias.to(cd)
        y = linear4bit_lora(x2, w, bias=bias, lora_a=res.lora_a, lora_b=res.lora_b,
                            scaling=res.scaling)
        return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
    if type(base) is not torch.nn.Linear:
        raise UnsupportedLinear(f"base layer is {type(base).__name__}, expected bitsandbytes "
                                "Linear4bit or torch.nn.Linear")
    y = torch.nn.functional.linear(x, base.weight, base.bias)
    if res.lora_a is None:
        return y
    xa = x.to(res.lora_a.dtype)
    lora = torch.nn.functional.linear(torch.nn.functional.linear(xa, res.lora_a), res.lora_b)
    return (y + lora * res.scaling).to(y.dtype)  # PEFT's lora.Linear order and roundings
