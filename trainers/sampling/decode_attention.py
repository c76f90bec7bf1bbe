"""Split-K decode attention over the static cache that reads each row's valid keys only.

One new token per row: q (B, H_kv, G, D) (the G = H / H_kv query heads of kv head h), the cache
K, V (B, H_kv, M, D), and `last` (B,): row b attends to keys j with lo_b <= j <= last_b, where
lo_b = max(0, last_b - w + 1) under a sliding window w, else 0.

    o[b, h, g] = Σ_j softmax_j(q[b, h, g] · K[b, h, j] · scale) V[b, h, j]

The keys [0, M) are cut into S splits of SPLIT_N; program (b·H_kv + h, s) runs the online softmax
over the valid keys of split s only (a split past last_b does no work, so the work and the
bytes read follow the row's length, not M) and writes its partial max m_s (G,), sum
l_s = Σ exp(z - m_s) (G,) and acc_s = Σ exp(z - m_s) V (G, D), all fp32. The combine:
m = max_s m_s, o = Σ_s e^{m_s - m} acc_s / Σ_s e^{m_s - m} l_s (an empty split has m_s = -inf,
l_s = 0, acc_s = 0 and weighs 0; split s ≤ last_b // SPLIT_N holds a valid key, so m is finite),
in the same launch: only the splits lo_b // SPLIT_N .. last_b // SPLIT_N hold keys; where that is
one split, its program writes o = acc_s / l_s itself (no partials, no counter), else each of
them stores its partials and the last to arrive (`kernels.arrivals`) reads them and writes o;
torch ops over all S splits instead when no counters exist (a first call under capture).
Static shapes throughout: capturable. Reads: the valid keys and values once, q once; writes
G·(D + 2) fp32 partials per split holding keys (none where one split holds them all) and reads
them back once.
"""

from __future__ import annotations

import collections

import torch
import triton
import triton.language as tl

from .kernels._interp import dot, interpreting, to_dtype
from .kernels.arrivals import arrival_counters
from .kernels.pdl import grid_wait, launch_args, let_next_launch, next_at_start
from .kernels.rope import ROPE_DTYPES, check_inputs, rope_cache_write, rope_rows
from .kernels.split_sum import CONSUMED, SplitSum, kernel_args, load_sum

SPLIT_N = 256  # keys per split
# launches by kernel ("attention", "rope_attention"): tests assert that the fused path ran
LAUNCHES: collections.Counter = collections.Counter()
# keys per inner step: the longer step where few (b, h) pairs leave most SMs idle, so each
# program's latency is the launch's; the shorter where many programs share the SMs (the launch
# grid's measured choice, bench/README.md)
BLOCK_N_FEW, BLOCK_N_MANY, FEW_PAIRS = 64, 32, 64
NUM_WARPS = 4  # a program's warps


@triton.jit
def _program(last_ptr, HKV):
    """(b·H_kv + h, s, b, h, last_b) of program (b·H_kv + h, s)."""
    bh = tl.program_id(0)
    b = bh // HKV
    return bh, tl.program_id(1), b, bh % HKV, tl.load(last_ptr + b)


@triton.jit
def _attend(q, k_ptr, v_ptr, last, m_ptr, l_ptr, acc_ptr, o_ptr, count_ptr, b, h, bh, s,
            stride_kb, stride_kh, stride_km, stride_vb, stride_vh, stride_vm, G, S, scale,
            window, D: tl.constexpr, BLOCK_G: tl.constexpr, SPLIT: tl.constexpr,
            BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr,
            COMBINE: tl.constexpr, INTERP: tl.constexpr):
    """Program (b·H_kv + h, s)'s part of the module docstring's attention for its queries q
    (BLOCK_G, D): the online softmax over split s's valid keys, then o (one split holds the
    keys), its partials, or the combine of (b, h)'s partials by the last split to arrive."""
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(last - window + 1, 0)
    start = tl.maximum(s * SPLIT, lo)
    end = tl.minimum(s * SPLIT + SPLIT, last + 1)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    g_ok = offs_g < G
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = offs_n < end
        k = tl.load(k_base + offs_n[:, None] * stride_km + offs_d[None, :], mask=ok[:, None],
                    other=0.0)  # (BLOCK_N, D)
        if IEEE:
            z = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:  # 16-bit tiles: products exact in fp32, fp32 sums (`_interp.dot`)
            z = dot(q, tl.trans(k), INTERP)
        z = tl.where(ok[None, :], z * scale, float("-inf"))  # (BLOCK_G, BLOCK_N) fp32
        # every block holds a valid key (n0 < end), so m_new is finite and alpha = e^{-inf} = 0
        # on the first block
        m_new = tl.maximum(m_i, tl.max(z, 1))
        p = tl.exp(z - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * stride_vm + offs_d[None, :], mask=ok[:, None],
                    other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, INTERP)
        m_i = m_new
    row = (bh * S + s) * BLOCK_G
    out = o_ptr + (bh * G + offs_g[:, None]) * D + offs_d[None, :]
    if COMBINE:
        # the splits first..final hold the keys lo..last; the others did no work and leave
        first = lo // SPLIT
        final = last // SPLIT
        if final == first:  # one split holds them all: o = acc / l (the combine's value)
            if s == first:
                tl.store(out, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty),
                         mask=g_ok[:, None])
        elif (s >= first) & (s <= final):
            tl.store(m_ptr + row + offs_g, m_i)
            tl.store(l_ptr + row + offs_g, l_i)
            tl.store(acc_ptr + (row + offs_g[:, None]) * D + offs_d[None, :], acc)
            # (b, h)'s last split to arrive combines them (kernels.arrivals): every thread's
            # partials are stored before the release, the others' are read after the acquire
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + bh, 1, sem="acq_rel", scope="gpu")
            if arrived == final - first:
                base = bh * S * BLOCK_G
                m = tl.full([BLOCK_G], float("-inf"), tl.float32)
                for t in range(first, final + 1):
                    m = tl.maximum(m, tl.load(m_ptr + base + t * BLOCK_G + offs_g))
                den = tl.zeros([BLOCK_G], tl.float32)
                num = tl.zeros([BLOCK_G, D], tl.float32)
                for t in range(first, final + 1):
                    r = base + t * BLOCK_G
                    w = tl.exp(tl.load(m_ptr + r + offs_g) - m)  # e^{m_s - m}
                    den += w * tl.load(l_ptr + r + offs_g)
                    num += w[:, None] * tl.load(acc_ptr + (r + offs_g[:, None]) * D
                                                + offs_d[None, :])
                tl.store(out, (num / den[:, None]).to(o_ptr.dtype.element_ty),
                         mask=g_ok[:, None])
                tl.atomic_xchg(count_ptr + bh, 0, sem="relaxed", scope="gpu")
    else:  # the caller's torch ops combine all S splits, empty ones included (m = -inf, l = 0)
        tl.store(m_ptr + row + offs_g, m_i)
        tl.store(l_ptr + row + offs_g, l_i)
        tl.store(acc_ptr + (row + offs_g[:, None]) * D + offs_d[None, :], acc)


@triton.jit
def _decode_attention_split_kernel(
    q_ptr, k_ptr, v_ptr, last_ptr, m_ptr, l_ptr, acc_ptr, o_ptr, count_ptr,
    stride_qb, stride_qh, stride_qg,
    stride_kb, stride_kh, stride_km,
    stride_vb, stride_vh, stride_vm,
    HKV, G, S, scale, window,
    D: tl.constexpr, BLOCK_G: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, COMBINE: tl.constexpr, PDL: tl.constexpr,
    INTERP: tl.constexpr, NEXT_AT_START: tl.constexpr = False,
):
    let_next_launch(NEXT_AT_START)  # kernels.pdl: the next kernel may launch now
    grid_wait(PDL)  # kernels.pdl: launched early, this kernel reads nothing before it
    bh, s, b, h, last = _program(last_ptr, HKV)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_g[:, None] * stride_qg
                + offs_d[None, :], mask=(offs_g < G)[:, None], other=0.0)  # (BLOCK_G, D)
    _attend(q, k_ptr, v_ptr, last, m_ptr, l_ptr, acc_ptr, o_ptr, count_ptr, b, h, bh, s,
            stride_kb, stride_kh, stride_km, stride_vb, stride_vh, stride_vm, G, S, scale,
            window, D, BLOCK_G, SPLIT, BLOCK_N, HAS_WINDOW, IEEE, COMBINE, INTERP)


@triton.jit
def _rope_attention_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qb_ptr, kb_ptr, vb_ptr,
    ck_ptr, cv_ptr, last_ptr, m_ptr, l_ptr, acc_ptr, o_ptr, count_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_qs, stride_ks,
    stride_vs, stride_c,
    stride_ckb, stride_ckh, stride_ckm, stride_cvb, stride_cvh, stride_cvm,
    HKV, G, S, P, M, scale, window,
    D: tl.constexpr, BLOCK_G: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, COMBINE: tl.constexpr, X_DT: tl.constexpr,
    Q_SPLITS: tl.constexpr, K_SPLITS: tl.constexpr, V_SPLITS: tl.constexpr,
    HAS_QB: tl.constexpr, HAS_KB: tl.constexpr, HAS_VB: tl.constexpr,
    PDL: tl.constexpr, INTERP: tl.constexpr, NEXT_AT_START: tl.constexpr = False,
):
    """`rope_attention`: program (b·H_kv + h, s) rotates its G query heads itself
    (`rope.rope_rows`, cos / sin at row last_b of the tables); the program whose split holds
    key last_b also rotates key head h, writes it and value head h to slot last_b of the
    cache (`rope_cache_write`'s values), and passes a CTA barrier before it reads them back;
    then `_attend`. q, k, v: the projections' outputs per head, each may be a SplitSum
    (its _SPLITS > 0) with a bias (HAS_*B)."""
    let_next_launch(NEXT_AT_START)  # kernels.pdl: the next kernel may launch now
    grid_wait(PDL)  # kernels.pdl: launched early, this kernel reads nothing before it
    bh, s, b, h, last = _program(last_ptr, HKV)
    OUT_DT: tl.constexpr = o_ptr.dtype.element_ty
    offs = tl.arange(0, D)
    cs_row = tl.load(last_ptr + b + offs * 0).to(tl.int64)  # (D,), every lane last_b
    cs_ok = (cs_row >= 0) & (cs_row < P)  # a slot past the tables reads zeros
    g = tl.arange(0, BLOCK_G)
    q = rope_rows(q_ptr + b * stride_qb, h * G + g, g < G, stride_qh, stride_qs, qb_ptr,
                  cos_ptr, sin_ptr, stride_c, cs_row, cs_ok, D, Q_SPLITS, HAS_QB, X_DT, OUT_DT,
                  INTERP).to(OUT_DT)  # (BLOCK_G, D), exact: OUT_DT values
    # key last_b's split: the new key and value into the cache (a slot outside [0, M) breaks
    # the attention's precondition, but is never written)
    if (s == last // SPLIT) & (last >= 0) & (last < M):
        one = tl.arange(0, 1)
        k = rope_rows(k_ptr + b * stride_kb, h + one, one == 0, stride_kh, stride_ks, kb_ptr,
                      cos_ptr, sin_ptr, stride_c, cs_row, cs_ok, D, K_SPLITS, HAS_KB, X_DT,
                      OUT_DT, INTERP)  # (1, D)
        kc = ck_ptr + b * stride_ckb + h * stride_ckh + last * stride_ckm + offs[None, :]
        tl.store(kc, to_dtype(k, ck_ptr.dtype.element_ty, INTERP))  # k.to(cache dtype)
        vb = vb_ptr + h * D + offs
        v = load_sum(v_ptr + b * stride_vb + h * stride_vh + offs, offs < D, stride_vs, vb,
                     V_SPLITS, HAS_VB, X_DT, INTERP)
        vc = cv_ptr + b * stride_cvb + h * stride_cvh + last * stride_cvm + offs
        tl.store(vc, to_dtype(v, cv_ptr.dtype.element_ty, INTERP))
        tl.debug_barrier()  # every thread's cache writes before any thread's reads below
    _attend(q, ck_ptr, cv_ptr, last, m_ptr, l_ptr, acc_ptr, o_ptr, count_ptr, b, h, bh, s,
            stride_ckb, stride_ckh, stride_ckm, stride_cvb, stride_cvh, stride_cvm, G, S,
            scale, window, D, BLOCK_G, SPLIT, BLOCK_N, HAS_WINDOW, False, COMBINE, INTERP)


def _config(B: int, HKV: int, config: dict | None) -> dict:
    return {"SPLIT_N": SPLIT_N, "BLOCK_N": BLOCK_N_FEW if B * HKV <= FEW_PAIRS else BLOCK_N_MANY,
            "num_warps": NUM_WARPS, "COMBINE": True, **(config or {})}


def _cache_reason(K, V, D: int) -> str | None:
    if K.stride(-1) != 1 or V.stride(-1) != 1 or D & (D - 1) or D < 16:
        return (f"decode_attention needs contiguous rows and a power-of-2 head dim >= 16, got "
                f"K strides {K.stride()}, D={D}")
    return None


def _partials(B: int, HKV: int, S: int, BLOCK_G: int, D: int, device) -> tuple:
    """(m, l, acc): each split's fp32 partials (the module docstring's m_s, l_s, acc_s)."""
    m = torch.empty(B * HKV * S * BLOCK_G, dtype=torch.float32, device=device)
    acc = torch.empty(B * HKV * S * BLOCK_G, D, dtype=torch.float32, device=device)
    return m, torch.empty_like(m), acc


def _combine_torch(m, l, acc, B: int, HKV: int, S: int, BLOCK_G: int, G: int, D: int, dtype):
    """o from all S splits' partials by torch ops (no arrival counters: a first capture)."""
    m = m.view(B, HKV, S, BLOCK_G)[..., :G]
    l = l.view(B, HKV, S, BLOCK_G)[..., :G]
    acc = acc.view(B, HKV, S, BLOCK_G, D)[..., :G, :]
    w = torch.exp(m - m.amax(2, keepdim=True))  # (B, H_kv, S, G): e^{m_s - m}, 0 if empty
    return ((w[..., None] * acc).sum(2) / (w * l).sum(2)[..., None]).to(dtype)


def decode_attention(q, K, V, last, *, scale: float, window: int | None = None,
                     config: dict | None = None):
    """o (B, H_kv, G, D) in q's dtype for q (B, H_kv, G, D), K / V (B, H_kv, M, D) (last dim
    contiguous), last (B,) int: the module docstring's attention over keys lo_b..last_b.
    `config` (benchmarks): SPLIT_N, BLOCK_N, num_warps (defaults: SPLIT_N, BLOCK_N_FEW for at
    most FEW_PAIRS (b, h) pairs else BLOCK_N_MANY, NUM_WARPS) and COMBINE (default True; False
    combines by torch ops, as a first call under capture does)."""
    B, HKV, G, D = q.shape
    cfg = _config(B, HKV, config)
    M = K.shape[2]
    why = _cache_reason(K, V, D)
    if why is not None:
        raise ValueError(why)
    q = q.contiguous()
    S = triton.cdiv(M, cfg["SPLIT_N"])
    BLOCK_G = max(16, triton.next_power_of_2(G))
    m, l, acc = _partials(B, HKV, S, BLOCK_G, D, q.device)
    o = torch.empty_like(q)  # (B, H_kv, G, D) contiguous
    counts = arrival_counters(q.device, B * HKV) if cfg["COMBINE"] else None
    _decode_attention_split_kernel[(B * HKV, S)](
        q, K, V, last, m, l, acc, o, counts if counts is not None else o,
        q.stride(0), q.stride(1), q.stride(2),
        K.stride(0), K.stride(1), K.stride(2),
        V.stride(0), V.stride(1), V.stride(2),
        HKV, G, S, scale, window or 0,
        D=D, BLOCK_G=BLOCK_G, SPLIT=cfg["SPLIT_N"], BLOCK_N=cfg["BLOCK_N"],
        HAS_WINDOW=window is not None, IEEE=q.dtype == torch.float32,
        COMBINE=counts is not None, INTERP=interpreting(), num_warps=cfg["num_warps"],
        **next_at_start(launch_args(_decode_attention_split_kernel, q.device)),
    )
    LAUNCHES["attention"] += 1
    if counts is not None:
        return o
    return _combine_torch(m, l, acc, B, HKV, S, BLOCK_G, G, D, q.dtype)


def rope_attention(q, k, v, cos, sin, cache_k, cache_v, slots, *, scale: float,
                   window: int | None = None, q_norm: tuple | None = None,
                   k_norm: tuple | None = None, config: dict | None = None):
    """o (B, H_kv, G, D) = decode_attention(rope_cache_write(q, k, v, cos, sin, cache_k,
    cache_v, slots, tables=True, q_norm=, k_norm=) viewed (B, H_kv, G, D), cache_k, cache_v,
    slots, scale=, window=) in one launch (`_rope_attention_kernel`): q (B, H, D), k and v
    (B, H_kv, D), each possibly a projection's SplitSum, cos / sin (P, D) tables read at each
    row's slot, which is also its last key. The same bits as the two calls, the cache written
    as `rope_cache_write` writes it. The two calls where the fused launch does not apply: q/k
    norms (Qwen3), a 32-bit rotation (its products and sums must stay separately rounded,
    which only the 16-bit roundings between them guarantee in a launch with fp contraction
    on, as the attention's), the torch path (CPU), or a cache `decode_attention` does not
    take. `config`: as `decode_attention`'s."""
    check_inputs(q, k, v, cos, sin, cache_k, cache_v, slots, q_norm, k_norm, True)
    B, Hq, D = q.shape
    HKV = k.shape[1]
    G = Hq // HKV
    y_dtype = q.dtype if q_norm is None else torch.promote_types(q_norm[0].dtype, q.dtype)
    out_dtype = torch.promote_types(y_dtype, cos.dtype)
    if not (q.device.type == "cuda" or interpreting()) or q_norm is not None or \
            out_dtype not in (torch.bfloat16, torch.float16) or \
            _cache_reason(cache_k, cache_v, D) is not None:
        q_rot = rope_cache_write(q, k, v, cos, sin, cache_k, cache_v, slots, q_norm=q_norm,
                                 k_norm=k_norm, tables=True)
        return decode_attention(q_rot.view(B, HKV, G, D), cache_k, cache_v, slots, scale=scale,
                                window=window, config=config)
    cfg = _config(B, HKV, config)
    x_dtype = q.dtype
    CONSUMED["rope_attention"] += sum(isinstance(t, SplitSum) for t in (q, k, v))
    q, k, v = (t if isinstance(t, SplitSum) or t.stride(-1) == 1 else t.contiguous()
               for t in (q, k, v))
    (q, q_s, q_b, q_n), (k, k_s, k_b, k_n), (v, v_s, v_b, v_n) = (
        kernel_args(t, tuple(t.shape)) for t in (q, k, v))
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    S = triton.cdiv(cache_k.shape[2], cfg["SPLIT_N"])
    BLOCK_G = max(16, triton.next_power_of_2(G))
    m, l, acc = _partials(B, HKV, S, BLOCK_G, D, q.device)
    o = torch.empty(B, HKV, G, D, device=q.device, dtype=out_dtype)
    counts = arrival_counters(q.device, B * HKV) if cfg["COMBINE"] else None
    _rope_attention_kernel[(B * HKV, S)](
        q, k, v, cos, sin, *(bias if bias is not None else cos for bias in (q_b, k_b, v_b)),
        cache_k, cache_v, slots, m, l, acc, o, counts if counts is not None else o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_s, k_s, v_s, cos.stride(0),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        cache_v.stride(0), cache_v.stride(1), cache_v.stride(2),
        HKV, G, S, cos.shape[0], cache_k.shape[2], scale, window or 0,
        D=D, BLOCK_G=BLOCK_G, SPLIT=cfg["SPLIT_N"], BLOCK_N=cfg["BLOCK_N"],
        HAS_WINDOW=window is not None, COMBINE=counts is not None,
        X_DT=ROPE_DTYPES[x_dtype],
        Q_SPLITS=q_n, K_SPLITS=k_n, V_SPLITS=v_n,
        HAS_QB=q_b is not None, HAS_KB=k_b is not None, HAS_VB=v_b is not None,
        INTERP=interpreting(), num_warps=cfg["num_warps"],
        **next_at_start(launch_args(_rope_attention_kernel, o.device)),
    )
    LAUNCHES["rope_attention"] += 1
    if counts is not None:
        return o
    return _combine_torch(m, l, acc, B, HKV, S, BLOCK_G, G, D, out_dtype)
