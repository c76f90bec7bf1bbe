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

import torch
import triton
import triton.language as tl

from .kernels._interp import dot, interpreting
from .kernels.arrivals import arrival_counters
from .kernels.pdl import grid_wait, launch_args

SPLIT_N = 256  # keys per split
# keys per inner step: the longer step where few (b, h) pairs leave most SMs idle, so each
# program's latency is the launch's; the shorter where many programs share the SMs (the launch
# grid's measured choice, bench/README.md)
BLOCK_N_FEW, BLOCK_N_MANY, FEW_PAIRS = 64, 32, 64
NUM_WARPS = 4  # a program's warps


@triton.jit
def _decode_attention_split_kernel(
    q_ptr, k_ptr, v_ptr, last_ptr, m_ptr, l_ptr, acc_ptr, o_ptr, count_ptr,
    stride_qb, stride_qh, stride_qg,
    stride_kb, stride_kh, stride_km,
    stride_vb, stride_vh, stride_vm,
    HKV, G, S, scale, window,
    D: tl.constexpr, BLOCK_G: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, COMBINE: tl.constexpr, PDL: tl.constexpr,
    INTERP: tl.constexpr,
):
    grid_wait(PDL)  # kernels.pdl: launched early, this kernel reads nothing before it
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    last = tl.load(last_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(last - window + 1, 0)
    start = tl.maximum(s * SPLIT, lo)
    end = tl.minimum(s * SPLIT + SPLIT, last + 1)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    g_ok = offs_g < G
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_g[:, None] * stride_qg
                + offs_d[None, :], mask=g_ok[:, None], other=0.0)  # (BLOCK_G, D)
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


def decode_attention(q, K, V, last, *, scale: float, window: int | None = None,
                     config: dict | None = None):
    """o (B, H_kv, G, D) in q's dtype for q (B, H_kv, G, D), K / V (B, H_kv, M, D) (last dim
    contiguous), last (B,) int: the module docstring's attention over keys lo_b..last_b.
    `config` (benchmarks): SPLIT_N, BLOCK_N, num_warps (defaults: SPLIT_N, BLOCK_N_FEW for at
    most FEW_PAIRS (b, h) pairs else BLOCK_N_MANY, NUM_WARPS) and COMBINE (default True; False
    combines by torch ops, as a first call under capture does)."""
    B, HKV, G, D = q.shape
    cfg = {"SPLIT_N": SPLIT_N, "BLOCK_N": BLOCK_N_FEW if B * HKV <= FEW_PAIRS else BLOCK_N_MANY,
           "num_warps": NUM_WARPS, "COMBINE": True, **(config or {})}
    M = K.shape[2]
    if K.stride(-1) != 1 or V.stride(-1) != 1 or D & (D - 1) or D < 16:
        raise ValueError(f"decode_attention needs contiguous rows and a power-of-2 head dim "
                         f">= 16, got K strides {K.stride()}, D={D}")
    q = q.contiguous()
    S = triton.cdiv(M, cfg["SPLIT_N"])
    BLOCK_G = max(16, triton.next_power_of_2(G))
    m = torch.empty(B * HKV * S * BLOCK_G, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(B * HKV * S * BLOCK_G, D, dtype=torch.float32, device=q.device)
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
        **launch_args(_decode_attention_split_kernel, q.device),
    )
    if counts is not None:
        return o
    m = m.view(B, HKV, S, BLOCK_G)[..., :G]
    l = l.view(B, HKV, S, BLOCK_G)[..., :G]
    acc = acc.view(B, HKV, S, BLOCK_G, D)[..., :G, :]
    w = torch.exp(m - m.amax(2, keepdim=True))  # (B, H_kv, S, G): e^{m_s - m}, 0 if empty
    return ((w[..., None] * acc).sum(2) / (w * l).sum(2)[..., None]).to(q.dtype)
