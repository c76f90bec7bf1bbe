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

Memory: the packed weight is read once (per block of 64 rows of x), never expanded to a bf16 copy
in memory; A and B are read from their storage at every call, so a captured CUDA graph sees each
optimizer step's values. Extra memory: t's split partials (SPLIT_T, M, R) fp32 and, when the K
loop is split over programs, the partial outputs (SPLIT_K, M, N) fp32.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from ..kernels._interp import dot, interpreting, to_dtype


@triton.jit
def _lora_t_kernel(
    x_ptr, a_ptr, t_ptr, M, K, R, K_PER_SPLIT,
    stride_xm, stride_ar, stride_ts, stride_tm,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """t_part[s] = x[:, ks] @ A[:, ks]ᵀ over this program's K slice ks, fp32 products and sums."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    k_lo = pid_s * K_PER_SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < tl.minimum(k_lo + K_PER_SPLIT, K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
        a = tl.load(a_ptr + offs_r[:, None] * stride_ar + offs_k[None, :],
                    mask=(offs_r[:, None] < R) & k_ok[None, :], other=0.0)
        # fp32 operands, "ieee": bf16 x bf16 products are exact in fp32, no tf32 rounding
        acc += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
    tl.store(t_ptr + pid_s * stride_ts + offs_m[:, None] * stride_tm + offs_r[None, :], acc,
             mask=(offs_m[:, None] < M) & (offs_r[None, :] < BLOCK_R))


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, R, SPLIT_T, scaling,
              t_ptr, b_ptr, bias_ptr, y_ptr, stride_ts, stride_tm, stride_bn, stride_ym,
              HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_R: tl.constexpr, INTERP: tl.constexpr):
    """y[m, n] = round(acc + s · t[m] · B[n] + bias[n]), the LoRA and bias terms in fp32."""
    m_ok = offs_m < M
    n_ok = offs_n < N
    if HAS_LORA:
        offs_r = tl.arange(0, BLOCK_R)
        t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for s in range(SPLIT_T):
            t += tl.load(t_ptr + s * stride_ts + offs_m[:, None] * stride_tm + offs_r[None, :],
                         mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_r[None, :],
                    mask=n_ok[:, None] & (offs_r[None, :] < R), other=0.0)
        acc += scaling * tl.dot(t, tl.trans(b.to(tl.float32)), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             to_dtype(acc, y_ptr.dtype.element_ty, INTERP), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _linear4bit_kernel(
    x_ptr, w_ptr, code_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr,
    t_ptr, b_ptr, bias_ptr, y_ptr, part_ptr,
    M, N, K, R, SPLIT_T, TILES_PER_SPLIT, scaling,
    stride_xm, stride_ts, stride_tm, stride_bn, stride_ym, stride_ps, stride_pm,
    BS: tl.constexpr, BS2: tl.constexpr, NESTED: tl.constexpr,
    HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    INTERP: tl.constexpr,
):
    """acc = x[m-block] @ round(W[n-block])ᵀ over this program's K tiles; then the epilogue, or
    the fp32 partial to part[pid_k] when the K loop is split over programs (SPLIT).

    A K tile of BLOCK_K elements is NB = BLOCK_K / BS absmax blocks of HB = BS / 2 bytes: the
    packed bytes load as (BLOCK_N, NB, HB), so one scale per (n, block) broadcasts over HB.
    The high nibbles are the even columns k = k0 + 2j and the low nibbles the odd ones, so x is
    read as its even and odd columns and the tile is two dots, never an interleave.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    NB: tl.constexpr = BLOCK_K // BS
    HB: tl.constexpr = BS // 2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    KB = K // BS  # absmax blocks per row
    n64 = offs_n.to(tl.int64)
    offs_b = tl.arange(0, NB)
    offs_h = tl.arange(0, HB)
    offs_j = tl.arange(0, BLOCK_K // 2)
    offset = tl.load(offset_ptr)  # the double-quant offset (a code entry, unused, otherwise)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    tile_lo = pid_k * TILES_PER_SPLIT
    for tile in range(tile_lo, tile_lo + TILES_PER_SPLIT):
        blk = tile * NB + offs_b  # (NB,) absmax block within the row
        blk_ok = n_ok[:, None] & (blk[None, :] < KB)  # (BLOCK_N, NB)
        ablk = n64[:, None] * KB + blk[None, :]  # (BLOCK_N, NB) flat absmax index
        if NESTED:
            qa = tl.load(absmax_ptr + ablk, mask=blk_ok, other=0)
            scale = tl.load(code2_ptr + qa.to(tl.int32)) * tl.load(
                absmax2_ptr + ablk // BS2, mask=blk_ok, other=0.0) + offset
        else:
            scale = tl.load(absmax_ptr + ablk, mask=blk_ok, other=0.0)
        # (BLOCK_N, NB, HB) packed bytes; read once, the only HBM traffic that scales with N·K
        p = tl.load(w_ptr + (ablk * HB)[:, :, None] + offs_h[None, None, :],
                    mask=blk_ok[:, :, None], other=0)
        q_hi = (p >> 4).to(tl.int32)
        q_lo = (p & 15).to(tl.int32)
        # code · absmax in fp32, then rounded to x's dtype: bitsandbytes' dequantized weight
        # the 16-entry table stays in L1: a gather per code
        c_hi = tl.load(code_ptr + q_hi, eviction_policy="evict_last")
        c_lo = tl.load(code_ptr + q_lo, eviction_policy="evict_last")
        w_hi = to_dtype(c_hi * scale[:, :, None], x_ptr.dtype.element_ty, INTERP)
        w_lo = to_dtype(c_lo * scale[:, :, None], x_ptr.dtype.element_ty, INTERP)
        w_hi = tl.reshape(w_hi, (BLOCK_N, BLOCK_K // 2))
        w_lo = tl.reshape(w_lo, (BLOCK_N, BLOCK_K // 2))
        k_even = tile * BLOCK_K + 2 * offs_j
        x_mask = m_ok[:, None] & (k_even[None, :] < K)
        x_even = tl.load(x_ptr + offs_m[:, None] * stride_xm + k_even[None, :],
                         mask=x_mask, other=0.0)
        x_odd = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k_even + 1)[None, :],
                        mask=x_mask, other=0.0)
        acc += dot(x_even, tl.trans(w_hi), INTERP)
        acc += dot(x_odd, tl.trans(w_lo), INTERP)
    if not SPLIT:
        _epilogue(acc, offs_m, offs_n, M, N, R, SPLIT_T, scaling, t_ptr, b_ptr, bias_ptr, y_ptr,
                  stride_ts, stride_tm, stride_bn, stride_ym, HAS_LORA, HAS_BIAS, BLOCK_M,
                  BLOCK_R, INTERP)
    else:
        tl.store(part_ptr + pid_k * stride_ps + offs_m[:, None] * stride_pm + offs_n[None, :],
                 acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _split_k_reduce_kernel(
    part_ptr, t_ptr, b_ptr, bias_ptr, y_ptr, M, N, R, SPLIT_T, SPLIT_K, scaling,
    stride_ps, stride_pm, stride_ts, stride_tm, stride_bn, stride_ym,
    HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, INTERP: tl.constexpr,
):
    """acc = Σ_s part[s] in a fixed order (deterministic), then the same epilogue."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * stride_ps + offs_m[:, None] * stride_pm + offs_n[None, :],
                       mask=mask, other=0.0)
    _epilogue(acc, offs_m, offs_n, M, N, R, SPLIT_T, scaling, t_ptr, b_ptr, bias_ptr, y_ptr,
              stride_ts, stride_tm, stride_bn, stride_ym, HAS_LORA, HAS_BIAS, BLOCK_M,
              BLOCK_R, INTERP)


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
    """Tile sizes and the split of the K loop. BLOCK_K is a multiple of the absmax block (128
    elements = 64 packed bytes per row: 4 KiB of weight per tile, few enough registers for the
    unpacked codes); the K loop is split until about two programs per SM are running, so that a
    small-M, small-N layer still streams its weight from every SM."""
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n = 64
    block_k = max(blocksize, 128)
    tiles = triton.cdiv(k, block_k)
    mn_progs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(2 * num_sms, mn_progs), tiles, 16))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split}


def lora_t(x: torch.Tensor, a: torch.Tensor, *, k_per_split: int = 1024):
    """t partials (SPLIT_T, M, BLOCK_R) fp32 whose sum over SPLIT_T is x @ Aᵀ (r padded)."""
    m, k = x.shape
    r = a.shape[0]
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_r = max(16, triton.next_power_of_2(r))
    split_t = triton.cdiv(k, k_per_split)
    t = torch.empty(split_t, m, block_r, device=x.device, dtype=torch.float32)  # small
    _lora_t_kernel[(triton.cdiv(m, block_m), split_t)](
        x, a, t, m, k, r, k_per_split, x.stride(0), a.stride(0), t.stride(0), t.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64)
    return t, block_r


def linear4bit_lora(x: torch.Tensor, w: Packed4bit, *, bias: torch.Tensor | None = None,
                    lora_a: torch.Tensor | None = None, lora_b: torch.Tensor | None = None,
                    scaling: float = 1.0, config: dict | None = None) -> torch.Tensor:
    """y (M, N) in x's dtype = x @ round(W)ᵀ + bias + scaling · (x @ lora_aᵀ) @ lora_bᵀ
    (module docstring for the bound). x (M, K) bf16/fp16; lora_a (r, K), lora_b (N, r) any
    float dtype, read at this call. `config`: BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K and optionally
    num_warps, num_stages (default `pick_config`)."""
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
    if has_lora:
        r = lora_a.shape[0]
        if lora_a.shape != (r, k) or lora_b.shape != (n, r):
            raise ValueError(f"lora_a {tuple(lora_a.shape)} and lora_b {tuple(lora_b.shape)} "
                             f"do not fit (r, K={k}) and (N={n}, r)")
        lora_a = lora_a if lora_a.stride(1) == 1 else lora_a.contiguous()
        lora_b = lora_b if lora_b.stride(1) == 1 else lora_b.contiguous()
        t, block_r = lora_t(x, lora_a)
    else:
        r, t, block_r, lora_b = 0, x, 16, x  # placeholders, never read (HAS_LORA=False)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({n},)")
    cfg = config or pick_config(m, n, k, w.blocksize, _num_sms(x.device))
    if cfg["BLOCK_K"] % w.blocksize:
        raise ValueError(f"config BLOCK_K={cfg['BLOCK_K']} is not a multiple of "
                         f"blocksize={w.blocksize}")
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)  # (M, N)
    tiles = triton.cdiv(k, cfg["BLOCK_K"])
    tiles_per = triton.cdiv(tiles, cfg["SPLIT_K"])
    split_k = triton.cdiv(tiles, tiles_per)  # no empty splits
    part = (torch.empty(split_k, m, n, device=x.device, dtype=torch.float32)  # (SPLIT_K, M, N)
            if split_k > 1 else y)
    bias_arg = bias if bias is not None else y
    nested = w.nested
    interp = interpreting()
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split_k)
    _linear4bit_kernel[grid](
        x, w.packed, w.code, w.absmax,
        w.code2 if nested else w.code, w.absmax2 if nested else w.code,
        w.offset if nested else w.code,
        t, lora_b, bias_arg, y, part,
        m, n, k, r, t.shape[0], tiles_per, float(scaling),
        x.stride(0), t.stride(0), t.stride(1), lora_b.stride(0), y.stride(0),
        part.stride(0) if split_k > 1 else 0, part.stride(1) if split_k > 1 else 0,
        BS=w.blocksize, BS2=w.blocksize2, NESTED=nested, HAS_LORA=has_lora,
        HAS_BIAS=bias is not None, SPLIT=split_k > 1, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], BLOCK_R=block_r, INTERP=interp,
        # no FMA contraction: the double-quant scale code2·absmax2 + offset is then formed with
        # the same two roundings as bitsandbytes' (a product, then an add)
        enable_fp_fusion=False, num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 3),
    )
    if split_k > 1:
        bm, bn = cfg["BLOCK_M"], 64
        _split_k_reduce_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            part, t, lora_b, bias_arg, y, m, n, r, t.shape[0], split_k, float(scaling),
            part.stride(0), part.stride(1), t.stride(0), t.stride(1), lora_b.stride(0),
            y.stride(0), HAS_LORA=has_lora, HAS_BIAS=bias is not None,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=block_r, INTERP=interp)
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
