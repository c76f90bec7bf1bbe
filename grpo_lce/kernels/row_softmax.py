"""Row statistics of a logits chunk, and the softmax-derived GEMM operands, in one kernel.

Per row c of a chunk (Z holds the fp32 product X_c @ Wᵀ, without bias or temperature):

    z    = (Z[c] + b) / τ                       fp32, never rounded to bf16
    lse  = log Σ_v exp(z_v)                     online: running max m, running Σ exp(z − m)
    z̄    = Σ_v p_v z_v,  p = exp((z − m) − log l)
    entropy = log l − d / l,  l = Σ exp(z − m),  d = Σ exp(z − m)(z − m)   (m = row max)

The entropy is kept relative to the row max: lse − z̄ would subtract two numbers ≈ m and lose
all digits of a peaked distribution's small entropy (1e-3 relative at H ≈ 0.02); log l and d / l
are both small there and exact to fp32 rounding. When the max moves from m to m',
d' = e^{m − m'} (d + l (m − m')). p's exponent is formed the same way, (z − m) − log l and not
z − lse: lse rounds to an ulp of |m| (2^-24 |m|, about 2e-6 at m = 30), an error every p would
carry as a relative one, where (z − m) − log l is exact to fp32 rounding of its own (small)
size near the max. That is what a peaked row's gradient needs: its p_y − 1 = −Σ_{v≠y} p_v is
small, and an absolute error of 2^-24 |m| in p_y against it (1e-3 relative at p_y = 0.998) is
what z − lse would give.
    z_y  = z[y_c];  argmax_v z_v                (log-prob of the target; token accuracy)

and, when a gradient is needed, a second pass over the row (p needs the final lse) writes

    G[c] = α_c · (p − e_y) + β_c · p ∘ (z − z̄)    in the GEMM dtype (bf16 for bf16 weights)
    E[c] = p ∘ (z − z̄)

∂(−log p_y)/∂z = p − e_y and ∂entropy/∂z = −p ∘ (z − z̄), so with α = 1, β = 0, G @ W is the
gradient basis of docs/DESIGN.md; with per-row α, β (the upstream gradients of the log-prob and
the entropy, times −1/τ) G is the whole ∂loss/∂(X Wᵀ) of the chunk, ready for dX = G W,
dW = Gᵀ X.

Memory traffic per chunk: read C·V·4 (pass 1), read C·V·4 + write C·V·2 per operand (pass 2).
"""

from __future__ import annotations

import torch

from grpo_lce.kernels import _tuning
from grpo_lce.kernels._triton import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _row_softmax_kernel(
        z_ptr, stride_zc,
        y_ptr, b_ptr,
        alpha_ptr, beta_ptr,
        g_ptr, stride_gc,
        e_ptr, stride_ec,
        lse_ptr, zy_ptr, ent_ptr, amax_ptr,
        V, inv_tau,
        HAS_BIAS: tl.constexpr,
        HAS_ALPHA: tl.constexpr,
        HAS_BETA: tl.constexpr,
        WRITE_G: tl.constexpr,
        WRITE_E: tl.constexpr,
        WRITE_AMAX: tl.constexpr,
        G_OVER_Z: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        c = tl.program_id(0).to(tl.int64)  # int64: c * stride exceeds 2**31 for big chunks
        z_row = z_ptr + c * stride_zc
        y = tl.load(y_ptr + c)

        # Pass 1: online max / Σexp / Σexp·z / argmax over the row, all in fp32.
        m_i = float("-inf")
        l_i = 0.0  # Σ exp(z − m_i)
        d_i = 0.0  # Σ exp(z − m_i) · (z − m_i)
        best_v = float("-inf")
        best_i = 0
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            # masked lanes read -inf so they add exp(-inf) = 0 to every sum and never win the max
            z = tl.load(z_row + cols, mask=mask, other=float("-inf"))
            if HAS_BIAS:
                z += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            z = z * inv_tau
            m_blk = tl.max(z, axis=0)
            m_new = tl.maximum(m_i, m_blk)
            scale = tl.exp(m_i - m_new)
            p = tl.exp(z - m_new)
            # p·(z − m) is 0·(−inf) = nan on masked lanes (and on −inf logits): keep those at 0
            pz = tl.where(p > 0.0, p * (z - m_new), 0.0)
            # l_i = 0 before the first finite logit, where m_i − m_new is nan or −inf
            shift = tl.where(l_i > 0.0, l_i * (m_i - m_new), 0.0)
            d_i = (d_i + shift) * scale + tl.sum(pz, axis=0)
            l_i = l_i * scale + tl.sum(p, axis=0)
            m_i = m_new
            if WRITE_AMAX:
                i_blk = tl.argmax(z, axis=0)
                take = m_blk > best_v  # strict: the first maximum wins, as torch.argmax
                best_i = tl.where(take, start + i_blk, best_i)
                best_v = tl.where(take, m_blk, best_v)

        log_l = tl.log(l_i)
        lse = m_i + log_l
        zbar = m_i + d_i / l_i
        # A target outside [0, V) is rejected on the host; clamp anyway so no read is ever wild.
        y_safe = tl.minimum(tl.maximum(y, 0), V - 1)
        z_y = tl.load(z_row + y_safe)
        if HAS_BIAS:
            z_y += tl.load(b_ptr + y_safe).to(tl.float32)
        z_y = z_y * inv_tau
        tl.store(lse_ptr + c, lse)
        tl.store(zy_ptr + c, z_y)
        tl.store(ent_ptr + c, tl.log(l_i) - d_i / l_i)
        if WRITE_AMAX:
            tl.store(amax_ptr + c, best_i)

        # Pass 2: p needs the final lse, so the row is read again to write the GEMM operands.
        if WRITE_G or WRITE_E:
            alpha = 1.0
            beta = 0.0
            if HAS_ALPHA:
                alpha = tl.load(alpha_ptr + c)
            if HAS_BETA:
                beta = tl.load(beta_ptr + c)
            g_row = g_ptr + c * stride_gc
            e_row = e_ptr + c * stride_ec
            for start in range(0, V, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                mask = cols < V
                z = tl.load(z_row + cols, mask=mask, other=0.0)
                if HAS_BIAS:
                    z += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                z = z * inv_tau
                p = tl.exp((z - m_i) - log_l)
                pc = tl.where(p > 0.0, p * (z - zbar), 0.0)
                if WRITE_G:
                    g = alpha * (p - tl.where(cols == y, 1.0, 0.0))
                    if HAS_BETA:
                        g += beta * pc
                    if G_OVER_Z:
                        # G overwrites the row's own bytes: G[j] lands on bytes of z[j'] with
                        # j' <= j, read in this step or an earlier one; the barrier makes every
                        # thread's read of this step happen before any thread's write.
                        tl.debug_barrier()
                    tl.store(g_row + cols, g.to(g_ptr.dtype.element_ty), mask=mask)
                if WRITE_E:
                    tl.store(e_row + cols, pc.to(e_ptr.dtype.element_ty), mask=mask)


def row_softmax(
    z: torch.Tensor,
    y: torch.Tensor,
    bias: torch.Tensor | None,
    inv_tau: float,
    *,
    backend: str,
    g_out: torch.Tensor | None = None,
    e_out: torch.Tensor | None = None,
    alpha: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    want_argmax: bool = False,
    out: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Statistics of the rows of z (C, V) fp32; writes the operands g_out / e_out (C, V) if given.
    `backend` (the call's Path, grpo_lce._dispatch): "triton", the kernel above, or "torch".

    Returns (lse, z_y, entropy, argmax), each (C,); fp32 but argmax (int64, or None); written
    into `out`'s four contiguous (C,) tensors when given (the chunk's slices of the caller's
    results: no per-chunk allocation or copy, which is what small calls pay for).
    `alpha`, `beta` (C,) fp32 are the per-row coefficients of G (defaults 1 and 0).
    g_out may alias z: a view of z's own rows (fp32 in place, or a narrower dtype over the first
    half of each fp32 row's bytes); z is then consumed.
    """
    C, V = z.shape
    assert z.dtype == torch.float32 and z.stride(1) == 1
    assert y.shape == (C,)
    if beta is not None:
        assert g_out is not None
    if out is None:
        lse = torch.empty(C, device=z.device, dtype=torch.float32)
        z_y = torch.empty_like(lse)
        ent = torch.empty_like(lse)
        amax = torch.empty(C, device=z.device, dtype=torch.int64) if want_argmax else None
    else:
        lse, z_y, ent, amax = out
        assert all(t.shape == (C,) and t.is_contiguous() for t in (lse, z_y, ent))
        assert (amax is not None) == want_argmax
    if C == 0:
        return lse, z_y, ent, amax
    if backend == "torch":
        res = _row_softmax_torch(z, y, bias, inv_tau, g_out, e_out, alpha, beta, want_argmax)
        if out is None:
            return res
        for dst, src in zip(out, res, strict=True):
            if dst is not None:
                dst.copy_(src)
        return lse, z_y, ent, amax
    for t in (g_out, e_out):
        assert t is None or t.stride(1) == 1
    _row_softmax_kernel[(C,)](
        z, z.stride(0),
        y, bias if bias is not None else z,
        alpha if alpha is not None else z, beta if beta is not None else z,
        g_out if g_out is not None else z, g_out.stride(0) if g_out is not None else 0,
        e_out if e_out is not None else z, e_out.stride(0) if e_out is not None else 0,
        lse, z_y, ent, amax if amax is not None else lse,
        V, inv_tau,
        HAS_BIAS=bias is not None,
        HAS_ALPHA=alpha is not None,
        HAS_BETA=beta is not None,
        WRITE_G=g_out is not None,
        WRITE_E=e_out is not None,
        WRITE_AMAX=want_argmax,
        G_OVER_Z=g_out is not None and _overlaps(g_out, z),
        BLOCK_V=min(_tuning.ROW_BLOCK_V, triton.next_power_of_2(V)),
        num_warps=_tuning.ROW_NUM_WARPS,
    )
    return lse, z_y, ent, amax


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b share storage (G written over Z to halve the chunk's memory)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _row_softmax_torch(z, y, bias, inv_tau, g_out, e_out, alpha, beta, want_argmax):
    """The same algorithm in torch ops (CPU, or no triton); allocates (C, V) temporaries."""
    zs = z if bias is None else z + bias.float()
    zs = zs * inv_tau  # (C, V) fp32 temporary
    # relative to the row max m (module docstring: p's exponent): zm = z − m ≤ 0, log l ≥ 0
    m = zs.amax(1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # an all −inf row: lse = −inf
    zm = zs - m[:, None]
    log_l = torch.log(torch.exp(zm).sum(1))
    lse = m + log_l
    p = torch.exp(zm - log_l[:, None])
    zero = torch.zeros((), dtype=zs.dtype, device=zs.device)
    # −Σ p log p = Σ p (log l − zm), each term ≥ 0: no cancellation for a peaked row
    ent = torch.where(p > 0, p * (log_l[:, None] - zm), zero).sum(1)
    zbar = lse - ent
    z_y = zs.gather(1, y.clamp(0, zs.shape[1] - 1)[:, None]).squeeze(1)
    amax = zs.argmax(1) if want_argmax else None
    if g_out is not None or e_out is not None:
        pc = torch.where(p > 0, p * (zs - zbar[:, None]), zero)
        if g_out is not None:
            g = p.clone()
            g.scatter_add_(1, y[:, None], torch.full_like(lse[:, None], -1.0))
            if alpha is not None:
                g *= alpha[:, None]
            if beta is not None:
                g += beta[:, None] * pc
            g_out.copy_(g)
        if e_out is not None:
            e_out.copy_(pc)
    return lse, z_y, ent, amax
