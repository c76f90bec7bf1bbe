"""Gumbel-max sampling over logit tiles: the next token of every row without the (B, V) logits.

h (B, H), W (V, H), b (V,), 1/τ, a per-row threshold t (B,) (−∞: none), a Philox seed s:

    z_bv  = (h_b · W_v + b_v) / τ                    fp32: a (BLOCK_V, BLOCK_B) tile of tl.dot
    kept  = {v : z_bv ≥ t_b}                         (the truncation of top-k / top-p / min-p)
    lse_b = log Σ_{v ∈ kept} exp(z_bv)               online: running max m, running Σ exp(z − m)
    g_bv  = −log E_bv,  E_bv = −log(1 − U_bv),  U_bv = Philox(s, b·V + v) ∈ [0, 1)
    tok_b = argmax_{v ∈ kept} (z_bv + g_bv)          (Gumbel-max: tok_b ~ softmax(z_b) on kept)
    logp_b = z_b,tok − lse_b

E is an Exp(1) variable and g a Gumbel one; E is computed from 1 − U so that the Gumbel's upper
tail (small E, the draws that decide a sample) keeps U's fine resolution near 0: U takes the
values k · 2⁻³¹ (fp32 is exact there), so E is resolved to ~2⁻³¹ where it is small, and U = 0
(probability 2⁻³¹) is floored to E = 2⁻³², g ≤ 22.2. The discreteness moves no token's
probability by more than ~2⁻³¹ per logit it competes with (≤ 6e-5 at V = 128k, worst case).
The noise is keyed by (row, vocab index), so the tokens do not depend on the tiling; ties go to
the lowest index, as torch.argmax.

Greedy (NOISE=False): the score is z itself, tok = the first argmax of z.

Grid (cdiv(B, BLOCK_B), P): program p streams the vocabulary tiles p·TILES … p·TILES + TILES − 1
and writes per row the partials of its slice of V (B, P): max m, Σ exp(z − m) l, best score s,
its index and its z. A second small kernel (`combine`) reduces the P slices of each row to the
token and its log-prob, or (STATS_ONLY: m and l only, the first pass of min-p) to the min-p
threshold. No host sync: the launches can be captured in a CUDA graph.

Memory traffic: W read once (V·H·elem), h read once per program (from L2), 5·B·P·4 bytes written.
z never leaves registers. z_tok is carried from the tile, so logp uses the same fp32 z as lse.
"""

from __future__ import annotations

import torch

from grpo_lce._dispatch import HAS_TRITON, interpreting

# Launch configuration on a GPU: memory-bound on W at decode batch sizes, so the vocabulary is
# split over many programs (V / BLOCK_V / TILES ≥ 4 per SM at a 128k vocabulary) to keep HBM
# streaming. BLOCK_B: the batch rounded up to a power of two in [16, 64] (16 is the smallest
# tl.dot N; rows past B masked); larger batches take several row blocks, which read the same W
# tile from L2. bench/sample.py --sweep times the alternatives.
SAMPLE_CONFIG = dict(BLOCK_V=128, BLOCK_B=64, BLOCK_H=128, TILES=1, num_warps=4, num_stages=4)
# up to 16 rows (one 16-row block): two vocabulary tiles per program on 8 warps, three stages,
# the sweep's best at batch 8 for H = 2048 and 4096 (bench/README.md, linear_sample)
SMALL_BATCH_CONFIG = dict(TILES=2, num_warps=8, num_stages=3)
# Under Triton's interpreter (CPU tests) each program costs a fixed amount of Python: few,
# large programs (BLOCK_B up to 1024 rows, `launch_config`).
INTERPRET_CONFIG = dict(BLOCK_V=64, BLOCK_B=1024, BLOCK_H=64, TILES=4, num_warps=4,
                        num_stages=1)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from grpo_lce.kernels.divergence_rows import _log1p

    @triton.jit
    def _sample_tiles_kernel(
        h_ptr, stride_hb, w_ptr, stride_wv, b_ptr, t_ptr, seed_ptr,
        m_ptr, l_ptr, s_ptr, i_ptr, zs_ptr,
        B, V, H, P, inv_tau,
        HAS_BIAS: tl.constexpr, HAS_THRESH: tl.constexpr, NOISE: tl.constexpr,
        STATS_ONLY: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr, EVEN_H: tl.constexpr,
        BLOCK_V: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, TILES: tl.constexpr,
    ):
        # the row blocks of one vocabulary slice are neighbours in launch order: they read the
        # same W tile, from L2 after the first
        pid_v = tl.program_id(1)
        offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        in_b = offs_b < B
        h_rows = h_ptr + offs_b.to(tl.int64)[None, :] * stride_hb  # (1, BLOCK_B)
        if HAS_THRESH:
            t = tl.load(t_ptr + offs_b, mask=in_b, other=float("-inf"))
        if NOISE:
            seed = tl.load(seed_ptr)
        m = tl.full((BLOCK_B,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_B,), tl.float32)
        s = tl.full((BLOCK_B,), float("-inf"), tl.float32)
        idx = tl.zeros((BLOCK_B,), tl.int32)
        zs = tl.zeros((BLOCK_B,), tl.float32)
        lanes = tl.arange(0, BLOCK_V)
        for j in range(TILES):
            v0 = (pid_v * TILES + j) * BLOCK_V
            offs_v = v0 + lanes
            in_v = offs_v < V
            w_rows = w_ptr + offs_v.to(tl.int64)[:, None] * stride_wv  # (BLOCK_V, 1)
            # z tile transposed, (BLOCK_V, BLOCK_B): W is the wide operand of the dot
            acc = tl.zeros((BLOCK_V, BLOCK_B), tl.float32)
            for h0 in range(0, H, BLOCK_H):
                hh = h0 + tl.arange(0, BLOCK_H)
                if EVEN_H:
                    w = tl.load(w_rows + hh[None, :], mask=in_v[:, None], other=0.0)
                    x = tl.load(h_rows + hh[:, None], mask=in_b[None, :], other=0.0)
                else:
                    w = tl.load(w_rows + hh[None, :], mask=in_v[:, None] & (hh < H)[None, :],
                                other=0.0)
                    x = tl.load(h_rows + hh[:, None], mask=in_b[None, :] & (hh < H)[:, None],
                                other=0.0)
                if DOT_F32:  # Triton's interpreter (CPU tests) mis-multiplies bf16 tiles
                    w = w.to(tl.float32)
                    x = x.to(tl.float32)
                # bf16: exact products, fp32 sums; fp32 inputs: full fp32 products, not TF32
                if IEEE:
                    acc = tl.dot(w, x, acc, input_precision="ieee")
                else:
                    acc = tl.dot(w, x, acc)
            z = acc
            if HAS_BIAS:
                z += tl.load(b_ptr + offs_v, mask=in_v, other=0.0).to(tl.float32)[:, None]
            z = z * inv_tau
            keep = in_v[:, None] & in_b[None, :]
            if HAS_THRESH:
                keep = keep & (z >= t[None, :])
            # −∞ outside the kept set: exp(−∞ − m) = 0 in l, never the argmax
            zk = tl.where(keep, z, float("-inf"))
            m_new = tl.maximum(m, tl.max(zk, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(zk - m_safe[None, :]), axis=0)
            m = m_new
            if not STATS_ONLY:
                if NOISE:
                    key = offs_b.to(tl.int64)[None, :] * V + offs_v[:, None]
                    u = tl.rand(seed, key)
                    # E = −log1p(−u) to a few ulp of u (1 − u alone would round away u's low
                    # bits), floored at 2⁻³² (u = 0)
                    e = tl.maximum(-_log1p(-u), 2.3283064365386963e-10)
                    score = tl.where(keep, z - tl.log(e), float("-inf"))
                else:
                    score = zk
                s_t = tl.max(score, axis=0)
                i_t = tl.argmax(score, axis=0, tie_break_left=True)
                z_t = tl.sum(tl.where(lanes[:, None] == i_t[None, :], z, 0.0), axis=0)
                # strict: an earlier tile (lower index) wins a tie
                better = s_t > s
                s = tl.where(better, s_t, s)
                idx = tl.where(better, v0 + i_t, idx)
                zs = tl.where(better, z_t, zs)
        out = offs_b.to(tl.int64) * P + pid_v
        tl.store(m_ptr + out, m, mask=in_b)
        tl.store(l_ptr + out, l, mask=in_b)
        if not STATS_ONLY:
            tl.store(s_ptr + out, s, mask=in_b)
            tl.store(i_ptr + out, idx, mask=in_b)
            tl.store(zs_ptr + out, zs, mask=in_b)


    @triton.jit
    def _combine_kernel(
        m_ptr, l_ptr, s_ptr, i_ptr, zs_ptr, tok_ptr, logp_ptr, t_ptr, B, P, log_min_p,
        THRESHOLD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_r = rows < B
        base = rows.to(tl.int64)[:, None] * P
        M = tl.full((BLOCK_R,), float("-inf"), tl.float32)
        L = tl.zeros((BLOCK_R,), tl.float32)
        S = tl.full((BLOCK_R,), float("-inf"), tl.float32)
        col = tl.zeros((BLOCK_R,), tl.int32)
        for p0 in range(0, P, BLOCK_P):
            cols = p0 + tl.arange(0, BLOCK_P)
            mk = in_r[:, None] & (cols < P)[None, :]
            m = tl.load(m_ptr + base + cols[None, :], mask=mk, other=float("-inf"))
            M_new = tl.maximum(M, tl.max(m, axis=1))
            if not THRESHOLD:
                l = tl.load(l_ptr + base + cols[None, :], mask=mk, other=0.0)
                Ms = tl.where(M_new == float("-inf"), 0.0, M_new)
                # a slice that kept nothing has m = −∞, l = 0: it adds 0
                L = L * tl.exp(M - Ms) + tl.sum(l * tl.exp(m - Ms[:, None]), axis=1)
                s = tl.load(s_ptr + base + cols[None, :], mask=mk, other=float("-inf"))
                s_b = tl.max(s, axis=1)
                c_b = p0 + tl.argmax(s, axis=1, tie_break_left=True)
                better = s_b > S  # strict: the earlier slice wins a tie
                S = tl.where(better, s_b, S)
                col = tl.where(better, c_b, col)
            M = M_new
        if THRESHOLD:
            # fp32: M + log min_p ≤ M, so the row's argmax (z = M exactly in the second pass:
            # the same kernel and tiles) is always kept
            tl.store(t_ptr + rows, M + log_min_p, mask=in_r)
        else:
            at = rows.to(tl.int64) * P + col
            tok = tl.load(i_ptr + at, mask=in_r, other=0)
            z_tok = tl.load(zs_ptr + at, mask=in_r, other=0.0)
            tl.store(tok_ptr + rows, tok.to(tl.int64), mask=in_r)
            tl.store(logp_ptr + rows, z_tok - (M + tl.log(tl.where(in_r, L, 1.0))), mask=in_r)


def launch_config(device: torch.device, B: int) -> dict:
    if device.type == "cuda" and not interpreting():
        cfg = dict(SAMPLE_CONFIG)
        cfg["BLOCK_B"] = min(cfg["BLOCK_B"], max(16, triton.next_power_of_2(B)))
        if cfg["BLOCK_B"] == 64:  # a (128, 64) fp32 tile and its noise: twice the threads
            cfg["num_warps"] = 8
        elif cfg["BLOCK_B"] == 16:
            cfg.update(SMALL_BATCH_CONFIG)
        return cfg
    cfg = dict(INTERPRET_CONFIG)
    cfg["BLOCK_B"] = min(cfg["BLOCK_B"], max(16, triton.next_power_of_2(B)))
    return cfg


def sample_tiles(h, w, bias, inv_tau, *, threshold=None, seed=None, stats_only=False,
                 config=None):
    """The (B, P) partials of `_sample_tiles_kernel` as a dict: m, l (and s, idx, zs unless
    `stats_only`). h (B, H) and w (V, H) unit-stride along H, same dtype; bias (V,) or None;
    threshold (B,) fp32 or None; seed int64 (1,) on the device, or None for greedy."""
    B, H = h.shape
    V = w.shape[0]
    cfg = dict(config or launch_config(h.device, B))
    n_tiles = triton.cdiv(V, cfg["BLOCK_V"])
    cfg["TILES"] = min(cfg["TILES"], n_tiles)  # no program of only masked tiles
    P = triton.cdiv(n_tiles, cfg["TILES"])
    f32 = dict(device=h.device, dtype=torch.float32)
    out = {"m": torch.empty(B, P, **f32), "l": torch.empty(B, P, **f32)}  # 2·B·P·4 bytes
    if not stats_only:
        out["s"] = torch.empty(B, P, **f32)
        out["zs"] = torch.empty(B, P, **f32)
        out["idx"] = torch.empty(B, P, device=h.device, dtype=torch.int32)
    dummy = out["m"]
    dot_f32 = h.device.type != "cuda" or interpreting()
    grid = (triton.cdiv(B, cfg["BLOCK_B"]), P)
    _sample_tiles_kernel[grid](
        h, h.stride(0), w, w.stride(0), bias if bias is not None else dummy,
        threshold if threshold is not None else dummy, seed if seed is not None else dummy,
        out["m"], out["l"], out.get("s", dummy), out.get("idx", dummy), out.get("zs", dummy),
        B, V, H, P, inv_tau,
        HAS_BIAS=bias is not None, HAS_THRESH=threshold is not None, NOISE=seed is not None,
        STATS_ONLY=stats_only, IEEE=h.dtype == torch.float32 or dot_f32, DOT_F32=dot_f32,
        EVEN_H=H % cfg["BLOCK_H"] == 0,
        BLOCK_V=cfg["BLOCK_V"], BLOCK_B=cfg["BLOCK_B"], BLOCK_H=cfg["BLOCK_H"],
        TILES=cfg["TILES"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def combine(part, *, log_min_p=None):
    """One launch over the (B, P) partials. With `log_min_p`: the min-p threshold
    t = max_p m_p + log(min_p) (B,) fp32 of a STATS_ONLY pass. Else (tokens int64 (B,),
    logp fp32 (B,)): lse = M + log Σ_p l_p e^{m_p − M}, the winner the first slice with the
    largest score (slices are in vocabulary order, so a tie goes to the lowest index), logp its
    z − lse."""
    m = part["m"]
    B, P = m.shape
    dev = m.device
    threshold = log_min_p is not None
    if threshold:
        t = torch.empty(B, device=dev, dtype=torch.float32)
        tok = logp = t
    else:
        tok = torch.empty(B, device=dev, dtype=torch.int64)
        logp = torch.empty(B, device=dev, dtype=torch.float32)
        t = logp
    on_gpu = dev.type == "cuda" and not interpreting()
    BLOCK_R = 16 if on_gpu else min(1024, max(16, triton.next_power_of_2(B)))
    _combine_kernel[(triton.cdiv(B, BLOCK_R),)](
        m, part["l"], part.get("s", m), part.get("idx", m), part.get("zs", m), tok, logp, t,
        B, P, log_min_p if threshold else 0.0,
        THRESHOLD=threshold, BLOCK_R=BLOCK_R, BLOCK_P=256 if on_gpu else 64, num_warps=4,
    )
    return t if threshold else (tok, logp)
