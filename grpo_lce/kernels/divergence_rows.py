"""Row statistics of a student and a teacher logits chunk: the divergence, the student's
entropy and the gradient operand, in one kernel.

Per row c of a chunk (S, T hold the fp32 products h_c Wᵀ and g_c Uᵀ, without bias or τ):

    s = (S[c] + b) / τ,   t = (T[c] + b_t) / τ          fp32, never rounded to bf16
    log p = (s − m_s) − log1p(r_s),   r_s = Σ_{v ≠ argmax} exp(s_v − m_s)   (m_s the row max;
                                       1 + r_s = Σ_v exp(s_v − m_s); q alike)
    entropy = log1p(r_s) − d_s / (1 + r_s),   d_s = Σ_v exp(s_v − m_s)(s_v − m_s)
    MODE 0 (β = 0):  D = KL(q‖p) = Σ q (log q − log p)           ∂D/∂s = p − q
    MODE 1 (β = 1):  D = KL(p‖q) = Σ p (log p − log q)           ∂D/∂s = p ∘ (log p − log q − D)
    MODE 2 (else):   log m = logaddexp(log p + log(1−β), log q + log β)
                     K_p = Σ p (log p − log m),  K_q = Σ q (log q − log m)
                     D = β K_q + (1−β) K_p                       ∂D/∂s = (1−β) p ∘ (log p − log m − K_p)

(MODE 2: the two KL terms' derivatives through log m add up to
−(1−β) Σ_v ∂p_v/∂s · (β q_v + (1−β) p_v) / m_v = −(1−β) ∂(Σ_v p_v)/∂s = 0, leaving the line
above.)

Precision. Every log-prob is taken relative to its row's max, and the mass of the row's other
tokens is kept apart as r (not as l = 1 + r): the most likely token's log p is −log1p(r), exact
to fp32 rounding of r itself. In fp32, l = 1 + 9e-6 keeps only 1% of the digits of its 9e-6,
so log l, hence a confident row's entropy (≈ r (gap + 1), 1e-4 for a logit gap of 11) and its
divergence, would be off by 6e-8 absolute, 5e-4 relative. log m = max(a, b) + log1p(e^{−|a−b|})
likewise. Pass 1 folds (m, r, d) online over the row: when a block brings a new max m' > m,
r' = (1 + r) e^{m − m'} + Σ_block e^{z − m'} without its argmax (whose term is exactly 1), and
d' = e^{m − m'} (d + (1 + r)(m − m')); otherwise r' = r + Σ_block e^{z − m} and
d' = d + Σ_block e^{z − m}(z − m).
log1p(r) is evaluated as log(1 + r) · r / ((1 + r) − 1) (exact to a few ulp; Triton's
interpreter has no log1p).

With a gradient wanted, G[c] = mul · scale_c · ∂D/∂s is written in the GEMM dtype (bf16 for bf16
weights, fp32 otherwise), optionally over the bytes of S's own row (G_OVER_S; see
grpo_lce._head.g_over_z): with mul = 1/τ and scale 1, G W is ∂D/∂h, the gradient basis; with
scale the upstream gradient of D, G is ∂loss/∂(h Wᵀ) for dh = G W, dW = Gᵀ h.

Memory traffic per chunk: pass 1 reads 2 C·V·4 bytes; pass 2 (D) reads them again, and writes G
for MODE 0; pass 3 (MODE 1, 2 with G) reads them a third time and writes C·V·2 (bf16) or ·4.
"""

from __future__ import annotations

import math

import torch

from grpo_lce.kernels import _tuning
from grpo_lce.kernels._triton import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _scaled(ptr, b_ptr, cols, mask, inv_tau, HAS_BIAS: tl.constexpr):
        # masked lanes read 0 here; callers keep them out of every sum with `mask`
        z = tl.load(ptr + cols, mask=mask, other=0.0)
        if HAS_BIAS:
            z += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        return z * inv_tau

    @triton.jit
    def _log1p(x):
        # log(1 + x) to a few ulp of x (Goldberg): 1 + x rounds, the ratio undoes the rounding
        w = 1.0 + x
        exact = w == 1.0
        return tl.where(exact, x, tl.log(w) * x / tl.where(exact, 1.0, w - 1.0))

    @triton.jit
    def _fold_max(z, m, r, d, lanes):
        # one block into the online (m, r, d) of the module docstring; z is −inf on masked lanes
        m_blk = tl.max(z, axis=0)
        m_new = tl.maximum(m, m_blk)
        scale = tl.exp(m - m_new)  # 0 on the first block (m = −inf), 1 if the max stays
        e = tl.exp(z - m_new)
        # e·(z − m) is 0·(−inf) = nan on masked lanes: keep those at 0
        ez = tl.where(e > 0.0, e * (z - m_new), 0.0)
        new_max = m_blk > m
        # a new max's own term (exactly 1) leaves r: it is the 1 of l = 1 + r
        drop = tl.where(new_max, 0.0, 1.0)
        e = tl.where(lanes == tl.argmax(z, axis=0), e * drop, e)
        # (1 + r)(m − m') is nan on the first block (−inf · 0): d is 0 there anyway
        shift = tl.where(m > float("-inf"), (1.0 + r) * (m - m_new), 0.0)
        d = (d + shift) * scale + tl.sum(ez, axis=0)
        r = tl.where(new_max, (1.0 + r) * scale, r) + tl.sum(e, axis=0)
        return m_new, r, d

    @triton.jit
    def _log_mix(a, b):
        # log(e^a + e^b) with the smaller term through log1p (module docstring)
        top = tl.maximum(a, b)
        return top + _log1p(tl.exp(tl.minimum(a, b) - top))

    @triton.jit
    def _divergence_rows_kernel(
        s_ptr, stride_sc,
        t_ptr, stride_tc,
        bs_ptr, bt_ptr,
        g_ptr, stride_gc,
        scale_ptr,
        d_ptr, ent_ptr,
        V, inv_tau, g_mul, beta, log_1mb, log_b,
        MODE: tl.constexpr,
        HAS_BIAS_S: tl.constexpr,
        HAS_BIAS_T: tl.constexpr,
        WRITE_G: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        G_OVER_S: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        c = tl.program_id(0).to(tl.int64)  # int64: c * stride exceeds 2**31 for big chunks
        s_row = s_ptr + c * stride_sc
        t_row = t_ptr + c * stride_tc

        # Pass 1: online (m, r, d) of both rows, all in fp32 (d_t is not used).
        m_s = float("-inf")
        r_s = 0.0
        d_s = 0.0
        m_t = float("-inf")
        r_t = 0.0
        d_t = 0.0
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            s = tl.where(mask, _scaled(s_row, bs_ptr, cols, mask, inv_tau, HAS_BIAS_S),
                         float("-inf"))
            t = tl.where(mask, _scaled(t_row, bt_ptr, cols, mask, inv_tau, HAS_BIAS_T),
                         float("-inf"))
            lanes = tl.arange(0, BLOCK_V)
            m_s, r_s, d_s = _fold_max(s, m_s, r_s, d_s, lanes)
            m_t, r_t, d_t = _fold_max(t, m_t, r_t, d_t, lanes)
        log_ls = _log1p(r_s)  # log Σ exp(s − m_s)
        log_lt = _log1p(r_t)
        tl.store(ent_ptr + c, log_ls - d_s / (1.0 + r_s))

        mul = g_mul
        if HAS_SCALE:
            mul = mul * tl.load(scale_ptr + c)
        g_row = g_ptr + c * stride_gc

        # Pass 2: D (MODE 0 also writes G = p − q here: it does not need D).
        acc = 0.0  # MODE 0, 1: D;  MODE 2: K_p
        acc_q = 0.0  # MODE 2: K_q
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            lp = _scaled(s_row, bs_ptr, cols, mask, inv_tau, HAS_BIAS_S) - m_s - log_ls
            lq = _scaled(t_row, bt_ptr, cols, mask, inv_tau, HAS_BIAS_T) - m_t - log_lt
            p = tl.where(mask, tl.exp(lp), 0.0)
            q = tl.where(mask, tl.exp(lq), 0.0)
            if MODE == 0:
                acc += tl.sum(tl.where(q > 0.0, q * (lq - lp), 0.0), axis=0)
                if WRITE_G:
                    g = mul * (p - q)
                    if G_OVER_S:
                        # G overwrites the row's own bytes: G[j] lands on bytes of s[j'] with
                        # j' <= j, read in this step or an earlier one; the barrier makes every
                        # thread's read of this step happen before any thread's write.
                        tl.debug_barrier()
                    tl.store(g_row + cols, g.to(g_ptr.dtype.element_ty), mask=mask)
            elif MODE == 1:
                acc += tl.sum(tl.where(p > 0.0, p * (lp - lq), 0.0), axis=0)
            else:
                lm = _log_mix(lp + log_1mb, lq + log_b)
                acc += tl.sum(tl.where(p > 0.0, p * (lp - lm), 0.0), axis=0)
                acc_q += tl.sum(tl.where(q > 0.0, q * (lq - lm), 0.0), axis=0)
        if MODE == 2:
            tl.store(d_ptr + c, beta * acc_q + (1.0 - beta) * acc)
        else:
            tl.store(d_ptr + c, acc)

        # Pass 3: G of MODE 1 and 2, which needs this row's D (K_p).
        if WRITE_G and MODE != 0:
            for start in range(0, V, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                mask = cols < V
                lp = _scaled(s_row, bs_ptr, cols, mask, inv_tau, HAS_BIAS_S) - m_s - log_ls
                lq = _scaled(t_row, bt_ptr, cols, mask, inv_tau, HAS_BIAS_T) - m_t - log_lt
                p = tl.exp(lp)
                if MODE == 1:
                    g = mul * tl.where(p > 0.0, p * (lp - lq - acc), 0.0)
                else:
                    lm = _log_mix(lp + log_1mb, lq + log_b)
                    g = (mul * (1.0 - beta)) * tl.where(p > 0.0, p * (lp - lm - acc), 0.0)
                if G_OVER_S:
                    tl.debug_barrier()  # as in pass 2
                tl.store(g_row + cols, g.to(g_ptr.dtype.element_ty), mask=mask)


def divergence_mode(beta: float) -> int:
    """0: forward KL(q‖p) (β = 0), 1: reverse KL(p‖q) (β = 1), 2: the generalized JSD."""
    return 0 if beta == 0.0 else 1 if beta == 1.0 else 2


def divergence_rows(
    s: torch.Tensor,
    t: torch.Tensor,
    s_bias: torch.Tensor | None,
    t_bias: torch.Tensor | None,
    inv_tau: float,
    beta: float,
    *,
    backend: str,
    g_out: torch.Tensor | None = None,
    g_mul: float = 1.0,
    g_scale: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """D and the student's entropy of the rows of s, t (C, V) fp32 into `out` = (d, ent), two
    contiguous (C,) fp32 tensors; G = g_mul · g_scale[c] · ∂D/∂s into g_out (C, V) when given.
    `backend` (the call's Path, grpo_lce._dispatch): "triton", the kernel above, or "torch".
    g_out may alias s (a view of its own rows, see grpo_lce._head.g_over_z); s is then consumed.
    """
    C, V = s.shape
    assert s.dtype == t.dtype == torch.float32 and s.stride(1) == t.stride(1) == 1
    assert t.shape == (C, V)
    d, ent = out
    if C == 0:
        return
    mode = divergence_mode(beta)
    if backend == "torch":
        _divergence_rows_torch(s, t, s_bias, t_bias, inv_tau, beta, mode, g_out, g_mul, g_scale,
                               d, ent)
        return
    assert g_out is None or g_out.stride(1) == 1
    _divergence_rows_kernel[(C,)](
        s, s.stride(0),
        t, t.stride(0),
        s_bias if s_bias is not None else s, t_bias if t_bias is not None else s,
        g_out if g_out is not None else s, g_out.stride(0) if g_out is not None else 0,
        g_scale if g_scale is not None else s,
        d, ent,
        V, inv_tau, g_mul, beta,
        # log(0) is never used: MODE 2 has 0 < β < 1
        math.log1p(-beta) if mode == 2 else 0.0, math.log(beta) if mode == 2 else 0.0,
        MODE=mode,
        HAS_BIAS_S=s_bias is not None,
        HAS_BIAS_T=t_bias is not None,
        WRITE_G=g_out is not None,
        HAS_SCALE=g_scale is not None,
        G_OVER_S=g_out is not None
        and g_out.untyped_storage().data_ptr() == s.untyped_storage().data_ptr(),
        BLOCK_V=min(_tuning.DIVERGENCE_BLOCK_V, triton.next_power_of_2(V)),
        num_warps=_tuning.ROW_NUM_WARPS,
    )


def _log_softmax_rel(z: torch.Tensor) -> torch.Tensor:
    """log softmax of the rows of z as (z − m) − log1p(r) (see module docstring)."""
    m, i = z.max(1, keepdim=True)
    u = z - m  # (C, V) temporary
    e = torch.exp(u).scatter_(1, i, 0.0)  # without the argmax's exact 1: e sums to r
    return u.sub_(torch.log1p(e.sum(1, keepdim=True)))


def _divergence_rows_torch(s, t, s_bias, t_bias, inv_tau, beta, mode, g_out, g_mul, g_scale,
                           d, ent):
    """The same algorithm in torch ops (CPU, or no triton); allocates (C, V) temporaries."""
    lp = _log_softmax_rel((s if s_bias is None else s + s_bias.float()) * inv_tau)
    lq = _log_softmax_rel((t if t_bias is None else t + t_bias.float()) * inv_tau)
    p = torch.exp(lp)
    zero = torch.zeros((), dtype=torch.float32, device=s.device)
    ent.copy_(-(p * lp).sum(1))
    if mode == 0:
        q = torch.exp(lq)
        d.copy_(torch.where(q > 0, q * (lq - lp), zero).sum(1))
        g = p - q
    elif mode == 1:
        r = lp - lq
        d.copy_(torch.where(p > 0, p * r, zero).sum(1))
        g = torch.where(p > 0, p * (r - d[:, None]), zero)
    else:
        q = torch.exp(lq)
        lm = torch.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))
        k_p = torch.where(p > 0, p * (lp - lm), zero).sum(1)
        k_q = torch.where(q > 0, q * (lq - lm), zero).sum(1)
        d.copy_(beta * k_q + (1.0 - beta) * k_p)
        g = (1.0 - beta) * torch.where(p > 0, p * (lp - lm - k_p[:, None]), zero)
    if g_out is not None:
        g = g * g_mul
        if g_scale is not None:
            g = g * g_scale[:, None]
        g_out.copy_(g)  # after every read of s: g_out may be a view of s's bytes
