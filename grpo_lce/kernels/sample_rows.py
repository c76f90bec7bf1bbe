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
values k · 2⁻³¹, so E ≥ 2⁻³¹ and g ≤ 21.5, a tail of mass e^{−21.5} ≈ 5e-10 per logit cut off
(≤ 6e-5 in total variation at V = 128k, in the worst case). The noise is keyed by (row, vocab
index), so the tokens do not depend on the tiling; ties go to the lowest index, as torch.argmax.

Greedy (NOISE=False): the score is z itself, tok = the first argmax of z.

Grid (P, cdiv(B, BLOCK_B)): program p streams the vocabulary tiles p·TILES … p·TILES + TILES − 1
and writes per row the partials of its slice of V (B, P): max m, Σ exp(z − m) l, best score s,
its index and its z. The reduction over the P slices is a few torch ops (`combine_partials`):
no host sync, CUDA-graph capturable. STATS_ONLY writes m and l only (the first pass of min-p).

Memory traffic: W read once (V·H·elem), h read once per program (from L2), 5·B·P·4 bytes written.
z never leaves registers. z_tok is carried from the tile, so logp uses the same fp32 z as lse.
"""

from __future__ import annotations

import torch

from grpo_lce._dispatch import HAS_TRITON, interpreting

# Launch configuration on a GPU: memory-bound on W at decode batch sizes, so the vocabulary is
# split over many programs (V / BLOCK_V / TILES ≥ 4 per SM at a 128k vocabulary) to keep HBM
# streaming; BLOCK_B = 16 is the smallest tl.dot N, rows past B masked. bench/sample.py --sweep
# times the alternatives.
SAMPLE_CONFIG = dict(BLOCK_V=128, BLOCK_B=16, BLOCK_H=128, TILES=1, num_warps=4, num_stages=4)
# Under Triton's interpreter (CPU tests) each program costs a fixed ~0.1 s of Python: few,
# large programs (BLOCK_B up to 1024 rows, `launch_config`).
INTERPRET_CONFIG = dict(BLOCK_V=64, BLOCK_B=1024, BLOCK_H=64, TILES=4, num_warps=4,
                        num_stages=1)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _sample_tiles_kernel(
        h_ptr, stride_hb, w_ptr, stride_wv, b_ptr, t_ptr, seed_ptr,
        m_ptr, l_ptr, s_ptr, i_ptr, zs_ptr,
        B, V, H, P, inv_tau,
        HAS_BIAS: tl.constexpr, HAS_THRESH: tl.constexpr, NOISE: tl.constexpr,
        STATS_ONLY: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr, EVEN_H: tl.constexpr,
        BLOCK_V: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, TILES: tl.constexpr,
    ):
        pid_v = tl.program_id(0)
        offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
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
                    # E = −log(1 − u): the series below 2⁻¹⁰ (error u⁴/4 ≤ 2e-13 · u, where
                    # 1 − u would round away u's low bits), floored at 2⁻³² (u = 0)
                    e = tl.where(u < 0.0009765625, u + u * u * (0.5 + u * 0.3333333333333333),
                                 -tl.log(1.0 - u))
                    e = tl.maximum(e, 2.3283064365386963e-10)
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


def launch_config(device: torch.device, B: int) -> dict:
    if device.type == "cuda" and not interpreting():
        return dict(SAMPLE_CONFIG)
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
    grid = (P, triton.cdiv(B, cfg["BLOCK_B"]))
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


def row_max(part) -> torch.Tensor:
    """max_v z_bv over the kept set, (B,) fp32, from the partials."""
    return part["m"].amax(1)


def combine_partials(part):
    """(tokens int64 (B,), logp fp32 (B,)) from the (B, P) partials, with torch ops only.

    lse = M + log Σ_p l_p e^{m_p − M}; the winner is the first slice with the largest score
    (torch.argmax returns the first maximum, and slices are in vocabulary order, so a tie goes
    to the lowest index); logp = its z − lse."""
    m, l = part["m"], part["l"]
    M = m.amax(1, keepdim=True)  # finite: every row keeps its argmax
    lse = M.squeeze(1) + torch.log((l * torch.exp(m - M)).sum(1))
    col = part["s"].argmax(1, keepdim=True)
    tok = part["idx"].gather(1, col).squeeze(1).long()
    logp = part["zs"].gather(1, col).squeeze(1) - lse
    return tok, logp
