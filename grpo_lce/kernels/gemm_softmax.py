"""GEMM 1 with the softmax statistics in its epilogue: the logits never reach memory.

For a chunk of rows X (M, K) and the head W (V, K), each tile Z = X_tile W_tileᵀ (fp32
accumulators, BM x BN) is turned, while still in registers, into per-(row, tile) partials in
base 2 (z₂ = z · log₂e, with z = (x·w + b) / τ), relative to a per-(row, tile) reference r_t:

    r_t        s_t = Σ 2^(z₂ − r_t)      d_t = Σ 2^(z₂ − r_t)(z₂ − m_t)      argmax_t

with m_t = max z₂ over the tile. Without a gradient r_t = m_t. `reduce_partials` folds the
T = V / BN partials of a row into lse, the entropy (lse − z̄ kept relative to the largest m_t)
and the argmax: exact fp32 statistics of the fp32 logits, after reading M · T numbers instead of
the M · V logits twice. Any reference gives the same sums; it only has to keep 2^(z₂ − r_t)
inside fp32. The target's logit zy₂ comes from its own dot product per row, before this launch
(kernels/target_logit): picking one column out of every tile cost the epilogue a compare, a
select and a sum per logit.

The gradient operand. The basis GEMM needs p = softmax(z) in bf16, and p needs the row's lse,
which no tile knows. So the epilogue writes instead

    G'[r, v] = 2^(z₂[r, v] − r_t),   r_t = max(c_r, m_t − CLAMP2)      in the GEMM dtype

with a per-row shift c_r fixed BEFORE the GEMM: c_r = zy₂_r + SHIFT2, from the target's logit.
The same 2^(z₂ − r_t) feeds the partials, so a tile costs one exp2 per logit. In a row with no
tile beyond c_r + CLAMP2 every reference is c_r, and p = G' · 2^(c_r − lse₂), a per-row factor
applied after GEMM 2 (basis = factor · G'W − W[y]), never to the (M, V) operand. bf16 has
fp32's exponent range, so G' keeps 8 significant bits whatever the shift, as long as it neither
overflows nor drops mass that matters:
  - max z₂ − c_r ≤ CLAMP2 (64): G' ≤ 2^64 and G'W sums stay far inside fp32. A row beyond it
    (max z − z_y > 96 ln 2 ≈ 66.5 nats, i.e. log p(target) below about −66) is *flagged* (some
    r_t > c_r): its factor is α alone and `rewrite_flagged` replaces its G' row with p itself
    (exp(z − lse), recomputed from W and x in fp32, stored in bf16) before GEMMs 2 and 3, which
    then treat it as any other row; its lse, entropy and argmax are exact as for any row. Such
    a row is a target of probability < e^-66: never sampled, and a broken model in SFT;
    correct, but slow (one pass over W per row).
  - c_r ≤ max z₂ + SHIFT2 (32), since z_y ≤ max z (up to the rounding of two fp32 sums of
    the same products): the entries G' rounds to 0 (z₂ < c_r − 126) carry
    < V · 2^(−126 + 32) ≈ 1e-23 of the row's mass (the same terms drop out of s_t).
Both follow from c_r's construction.
Because r_t is not the tile's max there, a launch with G' that wants the entropy or the argmax
also stores the tile maxima m_t (and d_t relative to them).

Layout: partials are (T, M) arrays (row index fastest), so the epilogue's stores of a tile's BM
rows and the reduction's loads are both contiguous.
"""

from __future__ import annotations

import math

import torch

from grpo_lce.kernels import _tuning
from grpo_lce.kernels._tma_common import num_programs
from grpo_lce.kernels._triton import HAS_TMA

if HAS_TMA:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from grpo_lce.kernels._tma_common import (
        dot_acc,
        round_to_bf16,
        tile_coords,
        valid_in_chunk,
    )

SHIFT2 = 32.0  # c = ẑ₂_y + SHIFT2 (base-2 units)
CLAMP2 = 64.0  # G' ≤ 2^CLAMP2; a row whose max exceeds c + CLAMP2 is flagged
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


if HAS_TMA:

    @triton.jit
    def _epilogue_part(
        acc, off_m, off_n, part,
        M, m_valid, V, scale2,
        b2_ptr, zy2_ptr, g_desc,
        pm_ptr, ps_ptr, pd_ptr, pa_ptr, pv_ptr,
        BM: tl.constexpr, BN: tl.constexpr,
        HAS_BIAS: tl.constexpr, WRITE_G: tl.constexpr,
        WANT_D: tl.constexpr, WANT_ARGMAX: tl.constexpr, MAX_APART: tl.constexpr,
        SHIFT: tl.constexpr, CLAMP: tl.constexpr, ROUND_BF16: tl.constexpr,
    ):
        rows = off_m + tl.arange(0, BM)
        cols = off_n + tl.arange(0, BN)
        rmask = rows < m_valid  # the partials' row stride stays M
        cmask = cols < V
        # columns past V read -inf: they add 2^-inf = 0 and never win the max (an added
        # column vector: one FMA per logit with the scale, no select)
        if HAS_BIAS:
            col = tl.load(b2_ptr + cols, mask=cmask, other=float("-inf"))
        else:
            col = tl.where(cmask, 0.0, float("-inf"))
        z = acc * scale2 + col[None, :]
        m = tl.max(z, axis=1)
        empty = m == float("-inf")  # a tile of only -inf logits
        m_safe = tl.where(empty, 0.0, m)
        if WRITE_G:
            # one exp2 serves G' and the partials: both relative to r = max(c, m − CLAMP),
            # which is c itself unless the row is flagged (module docstring). c = +inf past
            # the valid rows makes their G' 0 (GEMM 3's last K block reads them: gemm_rows)
            # with no select per logit; their partials are never stored.
            c2 = tl.load(zy2_ptr + rows, mask=rmask, other=float("inf")) + SHIFT
            ref = tl.maximum(c2, m_safe - CLAMP)
        else:
            ref = m_safe
        e = tl.exp2(z - ref[:, None])
        dst = part * M + rows
        # an empty tile has no mass at any reference: −inf keeps it out of the reduction's max
        tl.store(pm_ptr + dst, tl.where(empty, float("-inf"), ref), mask=rmask)
        tl.store(ps_ptr + dst, tl.sum(e, axis=1), mask=rmask)
        if WANT_D:
            # relative to the tile's max, not to r: the entropy is then a sum of small terms
            # (reduce); e · (z − m) is 0 · (−inf) = nan where z = −inf: those terms are 0
            ed = tl.where(e > 0.0, e * (z - m_safe[:, None]), 0.0)
            tl.store(pd_ptr + dst, tl.sum(ed, axis=1), mask=rmask)
        if MAX_APART:
            tl.store(pv_ptr + dst, m, mask=rmask)
        if WANT_ARGMAX:
            tl.store(pa_ptr + dst, off_n + tl.argmax(z, axis=1, tie_break_left=True), mask=rmask)
        if WRITE_G:
            g = e
            if ROUND_BF16:
                g = round_to_bf16(g)
            # (a TMA store: plain stores from the MMA's register layout are slower)
            g_desc.store([off_m, off_n], g.to(g_desc.dtype))

    @triton.jit(do_not_specialize=["row0"])
    def _gemm_softmax_kernel(
        x_desc, w_desc, g_desc,
        b2_ptr, zy2_ptr,
        pm_ptr, ps_ptr, pd_ptr, pa_ptr, pv_ptr, n_valid_ptr, row0,
        M, V, K, scale2, num_progs,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        GROUP_M: tl.constexpr, EPI_SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr, WRITE_G: tl.constexpr,
        WANT_D: tl.constexpr, WANT_ARGMAX: tl.constexpr, MAX_APART: tl.constexpr,
        DOT_F32: tl.constexpr, FLATTEN: tl.constexpr, SHIFT: tl.constexpr, CLAMP: tl.constexpr,
        G_BF16: tl.constexpr,
    ):
        # only the row blocks holding valid rows (the count is read on the device: gemm_rows)
        m_valid = valid_in_chunk(n_valid_ptr, row0, M)
        num_m = tl.cdiv(m_valid, BM)
        num_n = tl.cdiv(V, BN)
        k_tiles = tl.cdiv(K, BK)
        # persistent: one program per SM walks the tiles, so tile i+1's loads overlap tile i's
        # epilogue (whose exp2 and reductions are the same work per logit at any H: the smaller
        # H, the more they weigh against the tile's multiply-adds)
        for tile in tl.range(tl.program_id(0), num_m * num_n, num_progs, flatten=FLATTEN):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            off_m = pid_m * BM
            off_n = pid_n * BN
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for ki in range(k_tiles):
                a = x_desc.load([off_m, ki * BK])
                b = w_desc.load([off_n, ki * BK])
                acc = dot_acc(a, b.T, acc, DOT_F32)
            if EPI_SPLIT == 1:
                _epilogue_part(
                    acc, off_m, off_n, pid_n, M, m_valid, V, scale2, b2_ptr, zy2_ptr, g_desc,
                    pm_ptr, ps_ptr, pd_ptr, pa_ptr, pv_ptr,
                    BM, BN, HAS_BIAS, WRITE_G, WANT_D, WANT_ARGMAX, MAX_APART, SHIFT, CLAMP,
                    DOT_F32 and G_BF16,
                )
            else:
                # two column halves, one after the other: half the live registers of the
                # exp2 temporaries; each half is its own partial
                acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
                _epilogue_part(
                    acc0, off_m, off_n, 2 * pid_n, M, m_valid, V, scale2, b2_ptr, zy2_ptr,
                    g_desc, pm_ptr, ps_ptr, pd_ptr, pa_ptr, pv_ptr,
                    BM, BN // 2, HAS_BIAS, WRITE_G, WANT_D, WANT_ARGMAX, MAX_APART, SHIFT, CLAMP,
                    DOT_F32 and G_BF16,
                )
                _epilogue_part(
                    acc1, off_m, off_n + BN // 2, 2 * pid_n + 1, M, m_valid, V, scale2, b2_ptr,
                    zy2_ptr, g_desc, pm_ptr, ps_ptr, pd_ptr, pa_ptr, pv_ptr,
                    BM, BN // 2, HAS_BIAS, WRITE_G, WANT_D, WANT_ARGMAX, MAX_APART, SHIFT, CLAMP,
                    DOT_F32 and G_BF16,
                )

    @triton.jit(do_not_specialize=["row0"])
    def _reduce_kernel(
        pm_ptr, ps_ptr, pd_ptr, pa_ptr, pv_ptr, zy2_ptr, alpha_ptr,
        lse_ptr, zy_ptr, ent_ptr, amax_ptr, factor_ptr, flag_rows_ptr, n_flag_ptr,
        n_valid_ptr, row0, M, T,
        WANT_D: tl.constexpr, WANT_ARGMAX: tl.constexpr, MAX_APART: tl.constexpr,
        WANT_FACTOR: tl.constexpr, HAS_ALPHA: tl.constexpr, LN2_: tl.constexpr,
        SHIFT: tl.constexpr,
        BR: tl.constexpr, BT: tl.constexpr,
    ):
        # rows past the valid ones (never written by GEMM 1) get 0 everywhere, argmax −1.
        # Two running references: R, the largest r_t, scales the sums (every 2^(r_t − R) ≤ 1);
        # m, the largest tile max, is the origin of the entropy sum
        #     D = Σ_t 2^(r_t − R) (d_t + s_t (m_t − m)) = 2^(lse₂ − R) Σ_v p_v (z₂_v − m),
        # a sum of terms ≤ 0: H₂ = (lse₂ − m) − D / S is then as precise as lse₂ (D relative
        # to R would cancel ~R − m ≈ 30 in the G' launch, whose r_t is c). Without MAX_APART
        # the partials carry r_t = m_t and the two coincide.
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = rows < M
        valid = rows < valid_in_chunk(n_valid_ptr, row0, M)
        r = tl.full((BR,), float("-inf"), tl.float32)
        m = tl.full((BR,), float("-inf"), tl.float32)
        s = tl.zeros((BR,), tl.float32)
        d = tl.zeros((BR,), tl.float32)
        best_v = tl.full((BR,), float("-inf"), tl.float32)
        best_i = tl.zeros((BR,), tl.int32)
        for t0 in range(0, T, BT):
            t = t0 + tl.arange(0, BT)
            off = t[:, None] * M + rows[None, :]
            mk = (t < T)[:, None] & valid[None, :]
            pr = tl.load(pm_ptr + off, mask=mk, other=float("-inf"))
            ps = tl.load(ps_ptr + off, mask=mk, other=0.0)
            if MAX_APART:
                pv = tl.load(pv_ptr + off, mask=mk, other=float("-inf"))
            else:
                pv = pr
            r_new = tl.maximum(r, tl.max(pr, axis=0))
            r_safe = tl.where(r_new == float("-inf"), 0.0, r_new)
            w_old = tl.exp2(r - r_safe)
            w_prt = tl.exp2(pr - r_safe[None, :])
            v_blk = tl.max(pv, axis=0)
            if WANT_D:
                m_new = tl.maximum(m, v_blk)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                # a partial's d is relative to its tile max: moving it to m adds s · (m_t − m)
                pd = tl.load(pd_ptr + off, mask=mk, other=0.0)
                moved = tl.where(ps > 0.0, w_prt * (pd + ps * (pv - m_safe[None, :])), 0.0)
                d_old = tl.where(s > 0.0, d + s * (m - m_safe), 0.0)
                d = d_old * w_old + tl.sum(moved, axis=0)
                m = m_new
            s = s * w_old + tl.sum(w_prt * ps, axis=0)
            r = r_new
            if WANT_ARGMAX:
                pa = tl.load(pa_ptr + off, mask=mk, other=0)
                i_blk = tl.argmax(pv, axis=0, tie_break_left=True)
                a_blk = tl.sum(tl.where(tl.arange(0, BT)[:, None] == i_blk[None, :], pa, 0), 0)
                take = v_blk > best_v  # strict: the first (lowest-column) maximum wins
                best_i = tl.where(take, a_blk, best_i)
                best_v = tl.where(take, v_blk, best_v)
        s = tl.where(valid, s, 1.0)  # (a row past the valid ones: no 0/0 below)
        log2s = tl.log2(s)
        lse2 = tl.where(valid, r + log2s, 0.0)
        tl.store(lse_ptr + rows, lse2 * LN2_, mask=rmask)
        zy2 = tl.load(zy2_ptr + rows, mask=valid, other=0.0)
        tl.store(zy_ptr + rows, zy2 * LN2_, mask=rmask)
        if WANT_D:
            gap = tl.where(valid, r, 0.0) - tl.where(valid, m, 0.0)  # (−inf − −inf past them)
            ent2 = gap + log2s - d / s
            tl.store(ent_ptr + rows, tl.where(valid, ent2 * LN2_, 0.0), mask=rmask)
        if WANT_ARGMAX:
            tl.store(amax_ptr + rows, tl.where(valid, best_i, -1).to(tl.int64), mask=rmask)
        if WANT_FACTOR:
            # the G' launch's references are c unless a tile's max exceeded c + CLAMP
            c2 = zy2 + SHIFT
            flag = (r > c2) & valid
            if HAS_ALPHA:
                a = tl.load(alpha_ptr + rows, mask=valid, other=0.0)
            else:
                a = tl.where(valid, 1.0, 0.0)
            # a flagged row's G' row becomes p itself (rewrite_flagged): its factor is α.
            # 2^(c₂ − lse₂) as 2^((c₂ − R) − log₂ S): c₂ = R in an unflagged row, so no ulp of
            # lse₂ (2^-24 |lse₂|) enters p = factor · G' (row_softmax's docstring: p's exponent)
            factor = tl.where(flag, a, a * tl.exp2((c2 - r) - log2s))
            tl.store(factor_ptr + rows, tl.where(valid, factor, 0.0), mask=rmask)
            n_here = tl.sum(flag.to(tl.int32), axis=0)
            first = tl.atomic_add(n_flag_ptr, n_here)
            pos = first + tl.cumsum(flag.to(tl.int32), axis=0) - 1
            tl.store(flag_rows_ptr + pos, rows, mask=flag)  # rows of the chunk

    @triton.jit
    def _rewrite_flagged_kernel(
        x_ptr, stride_x, w_ptr, stride_w, b_ptr, g_ptr, stride_g,
        flag_rows_ptr, n_flag_ptr, lse_ptr, V, H, inv_tau,
        HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr, BV: tl.constexpr, BH: tl.constexpr,
    ):
        # One program per block of BV vocabulary rows; for each flagged row r of the chunk
        # (usually none: the loop count is read on the device, no host sync) it recomputes
        # z = W_blk x_r in fp32 and stores p = exp(z − lse_r) over G'[r, blk].
        v = tl.program_id(0) * BV + tl.arange(0, BV)
        vmask = v < V
        v64 = v.to(tl.int64)
        n_flag = tl.load(n_flag_ptr)
        for i in range(n_flag):
            r = tl.load(flag_rows_ptr + i).to(tl.int64)
            z = tl.zeros((BV,), tl.float32)
            for h0 in range(0, H, BH):
                hh = h0 + tl.arange(0, BH)
                hmask = hh < H
                x = tl.load(x_ptr + r * stride_x + hh, mask=hmask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + v64[:, None] * stride_w + hh[None, :],
                            mask=vmask[:, None] & hmask[None, :], other=0.0).to(tl.float32)
                z += tl.sum(w * x[None, :], axis=1)
            if HAS_BIAS:
                z += tl.load(b_ptr + v, mask=vmask, other=0.0).to(tl.float32)
            p = tl.exp(z * inv_tau - tl.load(lse_ptr + r))
            if ROUND_BF16:
                p = round_to_bf16(p)
            tl.store(g_ptr + r * stride_g + v, p.to(g_ptr.dtype.element_ty), mask=vmask)


def g_row_stride(V: int) -> int:
    """Row stride (elements) of a G' buffer: V rounded up to 16 bytes, as TMA stores need."""
    return -(-V // 8) * 8


def _config(with_g: bool) -> dict:
    return _tuning.GEMM_GRAD if with_g else _tuning.GEMM_STATS


def group_m(cfg: dict, K: int, elem_size: int) -> int:
    """Row tiles per tile group: GROUP_M, or for a config with GROUP_M_MAX the most (a power of
    two, GROUP_M..GROUP_M_MAX) whose X slab, GROUP_M · BM · K elements, fits GROUP_X_BYTES:
    the group's rows stay in L2 while it sweeps W once (see _tuning)."""
    g = cfg["GROUP_M"]
    while (2 * g <= cfg.get("GROUP_M_MAX", g)
           and 2 * g * cfg["BM"] * K * elem_size <= _tuning.GROUP_X_BYTES):
        g *= 2
    return g


def n_parts(V: int, with_g: bool) -> int:
    """Partials per row (T) of the launch with or without G'."""
    cfg = _config(with_g)
    return -(-V // cfg["BN"]) * cfg["EPI_SPLIT"]


def gemm_softmax(
    x: torch.Tensor,
    w: torch.Tensor,
    b2: torch.Tensor | None,
    inv_tau: float,
    parts: dict[str, torch.Tensor],
    *,
    zy2: torch.Tensor | None = None,
    g_out: torch.Tensor | None = None,
    want_d: bool = False,
    want_argmax: bool = False,
    n_valid: torch.Tensor | None = None,
    row0: int = 0,
) -> None:
    """Launch GEMM 1 with the statistics epilogue over the rows of x (M, K).

    Only the rows below `n_valid` − `row0` are computed (n_valid: int32 (1,) on the device, the
    valid rows of the whole call, x the chunk starting at row0; None: all M); G' is 0 past them.

    `parts` holds (T, M)-shaped (or larger, flattened) fp32 buffers "m", "s", "d", "v" (the
    tile maxima, see `keeps_tile_max`) and int32 "a". `b2` is the bias already scaled by
    log₂e / τ (fp32). With `g_out` (M, V) (row stride `g_row_stride(V)`), also writes G' with the
    per-row shifts zy₂ + SHIFT2, `zy2` (M,) the rows' target logits (kernels/target_logit).
    """
    M, K = x.shape
    V = w.shape[0]
    max_apart = keeps_tile_max(g_out is not None, want_d, want_argmax)
    assert not max_apart or "v" in parts
    cfg = _config(g_out is not None)
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    x_desc = TensorDescriptor.from_tensor(x, [BM, BK])
    w_desc = TensorDescriptor.from_tensor(w, [BN, BK])
    if g_out is not None:
        assert g_out.shape == (M, V) and g_out.stride(1) == 1 and zy2 is not None
        g_desc = TensorDescriptor(g_out, [M, V], [g_out.stride(0), 1],
                                  [BM, BN // cfg["EPI_SPLIT"]])
    else:
        g_desc = x_desc  # unused (WRITE_G=False); any descriptor fills the slot
    # a run-time program count: small calls (fewer tiles than SMs) compile no new variant
    n_prog = min(num_programs(x.device), triton.cdiv(M, BM) * triton.cdiv(V, BN))
    m_buf = parts["m"]
    _gemm_softmax_kernel[(n_prog,)](
        x_desc, w_desc, g_desc,
        b2 if b2 is not None else m_buf, zy2 if zy2 is not None else m_buf,
        m_buf, parts["s"], parts.get("d", m_buf), parts.get("a", m_buf),
        parts.get("v", m_buf), _count(n_valid, row0 + M, x.device), row0,
        M, V, K, inv_tau * LOG2E, n_prog,
        BM=BM, BN=BN, BK=BK, GROUP_M=group_m(cfg, K, x.element_size()),
        EPI_SPLIT=cfg["EPI_SPLIT"],
        HAS_BIAS=b2 is not None, WRITE_G=g_out is not None,
        WANT_D=want_d, WANT_ARGMAX=want_argmax, MAX_APART=max_apart,
        DOT_F32=not x.is_cuda, FLATTEN=cfg["FLATTEN"], SHIFT=SHIFT2, CLAMP=CLAMP2,
        G_BF16=g_out is not None and g_out.dtype == torch.bfloat16,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def reduce_partials(
    parts: dict[str, torch.Tensor],
    M: int,
    T: int,
    out: tuple,
    zy2: torch.Tensor,
    *,
    alpha: torch.Tensor | None = None,
    factor: torch.Tensor | None = None,
    flag_rows: torch.Tensor | None = None,
    n_flag: torch.Tensor | None = None,
    n_valid: torch.Tensor | None = None,
    row0: int = 0,
) -> None:
    """Fold the partials into out = (lse, z_y, entropy or None, argmax or None), each (M,);
    z_y is the chunk's `zy2` (kernels/target_logit) in natural units. Rows past the valid ones
    (see gemm_softmax) get 0, argmax −1, factor 0.

    `factor` is given exactly when the partials come from a launch with G' (the operand is only
    ever wanted with its factor): then also the per-row factor α · 2^(c₂ − lse₂), c₂ = zy₂ + SHIFT2,
    that turns G' into α · p (α for a flagged row), and lists the flagged rows in `flag_rows`
    as rows of the chunk, counting them in `n_flag` (int32, (1,), zeroed by the caller), for
    `rewrite_flagged` to replace their G' rows with p before the chunk's GEMMs 2 and 3.
    """
    lse, z_y, ent, amax = out
    m_buf = parts["m"]
    max_apart = keeps_tile_max(factor is not None, ent is not None, amax is not None)
    assert not max_apart or "v" in parts
    cfg = _tuning.REDUCE
    _reduce_kernel[(triton.cdiv(M, cfg["BR"]),)](
        m_buf, parts["s"], parts.get("d", m_buf), parts.get("a", m_buf),
        parts.get("v", m_buf), zy2, alpha if alpha is not None else m_buf,
        lse, z_y, ent if ent is not None else lse, amax if amax is not None else lse,
        factor if factor is not None else lse,
        flag_rows if flag_rows is not None else lse, n_flag if n_flag is not None else lse,
        _count(n_valid, row0 + M, lse.device), row0, M, T,
        WANT_D=ent is not None, WANT_ARGMAX=amax is not None, MAX_APART=max_apart,
        WANT_FACTOR=factor is not None, HAS_ALPHA=alpha is not None, LN2_=LN2, SHIFT=SHIFT2,
        BR=cfg["BR"], BT=cfg["BT"], num_warps=cfg["num_warps"],
    )


def keeps_tile_max(with_g: bool, want_d: bool, want_argmax: bool) -> bool:
    """Whether a launch also stores the tile maxima ("v"): when its references are not them
    (the G' launch) and the entropy or the argmax needs them."""
    return with_g and (want_d or want_argmax)


def _count(n_valid: torch.Tensor | None, default: int, device) -> torch.Tensor:
    if n_valid is not None:
        return n_valid
    return torch.full((1,), default, device=device, dtype=torch.int32)


def rewrite_flagged(
    g: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    inv_tau: float,
    lse: torch.Tensor,
    flag_rows: torch.Tensor,
    n_flag: torch.Tensor,
) -> None:
    """Over the G' rows (M, V) of a chunk, the exact p of its flagged rows (the first n_flag
    entries of flag_rows, rows of the chunk, as reduce_partials lists them), from the chunk's
    rows x (M, H), w, bias, 1/τ and lse (M,) (natural units). One pass over W per flagged row;
    one launch that returns at once when there is none."""
    V, H = w.shape
    BV, BH = 64, 128
    _rewrite_flagged_kernel[(triton.cdiv(V, BV),)](
        x, x.stride(0), w, w.stride(0), bias if bias is not None else lse, g, g.stride(0),
        flag_rows, n_flag, lse, V, H, inv_tau,
        HAS_BIAS=bias is not None, ROUND_BF16=g.dtype == torch.bfloat16 and not g.is_cuda,
        BV=BV, BH=BH, num_warps=4,
    )
