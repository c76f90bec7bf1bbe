"""linear_divergence: the divergence between a student's and a teacher's next-token distributions
over the full vocabulary, from both models' hidden states and LM heads, without (N, V) logits.

h (N, Hs), W (V, Hs), b (V,) the student;  g (N, Ht), U (V, Ht), c (V,) the teacher;  τ;  β ∈ [0, 1]
    s = (h Wᵀ + b) / τ,   t = (g Uᵀ + c) / τ         chunks of C rows, fp32 (accumulated and kept)
    p = softmax(s),  q = softmax(t)
    β = 0:     D = KL(q‖p)                             ∂D/∂s = p − q           (forward KL)
    β = 1:     D = KL(p‖q)                             ∂D/∂s = p ∘ (log p − log q − D)
    0 < β < 1: D = β KL(q‖m) + (1−β) KL(p‖m),  m = (1−β) p + β q
                                                       ∂D/∂s = (1−β) p ∘ (log p − log m − KL(p‖m))
    H = −Σ p log p                                     the student's entropy (a metric: no gradient)
    ∂D/∂h = (∂D/∂s / τ) W                              (N, Hs): the gradient basis

These are TRL 1.16's definitions (`trl.kernels.chunked_divergence`, the DistillationTrainer's
`beta`), per token, unreduced. Only the student gets a gradient; the teacher's inputs are
constants. Hs and Ht may differ; V may not. The row math and its precision argument are in
grpo_lce/kernels/divergence_rows.py.

Two implementations, one switch: `method=`.

  "basis" (the default)  per chunk, GEMMs S = h Wᵀ and T = g Uᵀ into two fp32 (C, V) buffers;
      the row kernel (kernels/divergence_rows: Triton on CUDA, torch ops elsewhere) writes D, H
      and G = ∂D/∂s / τ over S's own bytes (in the GEMM dtype). A frozen student head (LoRA,
      QLoRA) then builds basis = G W (C, Hs) in the same chunk, and the backward is elementwise,
      dh_n = ḡ_n · basis_n for any upstream gradient ḡ: 3 GEMMs in all. A trainable head or bias:
      the forward keeps D and H only (2 GEMMs); the backward recomputes each chunk with G scaled
      by ḡ_n / τ, giving dh = G W, dW = Gᵀ h, db = Σ_rows G (4 GEMMs).
  "chunked"  `grpo_lce.chunked_linear` with a plain-torch function of the student's logits chunk
      that computes the teacher's chunk itself (g's rows as a row argument, U from a closure)
      and D in differentiable torch; autograd differentiates it in the backward. Forward 2 GEMMs,
      backward 2 + dX (+ dW): 5 GEMMs frozen, 6 trainable. No derivative is written by hand: the
      cross-check of "basis", and the other side of an A/B timing.

Extra memory of a call, beyond inputs and outputs: "basis" holds two fp32 (C, V) buffers (plus,
on the torch row path, the row ops' (C, V) temporaries, which the default chunk size counts) and
keeps the fp32 basis (n, Hs) of the n unmasked rows for a frozen head, nothing else (not h, not
g); a trainable head keeps h and g for its recompute. "chunked" holds one chunk's logits and the
autograd graph of the row function (about eight (C, V) fp32 tensors). Rows whose `mask` is 0 are
dropped before any GEMM (one host read a call: their number sizes the GEMMs) and get 0 in every
output and gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpo_lce._checks import check_chunk_size, check_head, check_temperature
from grpo_lce._chunks import default_chunk_size
from grpo_lce._dispatch import decide
from grpo_lce._head import HeadPass, chunk_loop, chunk_rows, gemm_weight
from grpo_lce._mm import mm_f32
from grpo_lce.chunked import chunked_linear
from grpo_lce.kernels.divergence_rows import divergence_mode, divergence_rows

METHODS = ("basis", "chunked")

# (C, V) fp32 buffers a chunk row costs besides S: T on the Triton path; on the torch path also
# the row ops' temporaries (log p, log q, p, q, log m and a product, at their peak).
_EXTRA_ROWS = {"triton": 1, "torch": 7}
# "chunked": the logits chunk and the autograd graph of `_divergence_autograd` for it.
_CHUNKED_ROWS = 8


@dataclass
class _PassOut:
    d: torch.Tensor  # (n,) fp32
    entropy: torch.Tensor  # (n,) fp32
    basis: torch.Tensor | None = None  # (n, Hs) fp32: G W (frozen head), or dh (recompute)
    grad_weight: torch.Tensor | None = None  # (V, Hs) fp32: Gᵀ h
    grad_bias: torch.Tensor | None = None  # (V,) fp32: Σ_rows G


@dataclass(frozen=True)
class _Teacher:
    """The teacher's side of a pass: its rows g (n, Ht) and head U (V, Ht), c (V,) or None."""

    g: torch.Tensor
    u: torch.Tensor
    c: torch.Tensor | None


def _divergence_pass(h, w, b, teacher: _Teacher, spec: HeadPass, beta: float, backend: str,
                     g_scale: torch.Tensor | None = None) -> _PassOut:
    """One pass over the student's rows h (n, Hs) and the teacher's ("basis", module docstring):
    the head's unfused chunk loop (grpo_lce._head.chunk_loop) with the divergence row kernel.
    G = g_scale_n / τ · ∂D/∂s (g_scale None: 1) feeds the GEMMs `spec` asks for."""
    n, Hs = h.shape
    V = w.shape[0]
    dev = h.device
    ws, wt = gemm_weight(w, backend), gemm_weight(teacher.u, backend)
    # on CPU a bf16 head's GEMMs run on an fp32 copy (gemm_weight): the rows follow, once
    h = h if h.dtype == ws.dtype else h.to(ws.dtype)
    g = teacher.g if teacher.g.dtype == wt.dtype else teacher.g.to(wt.dtype)
    out = _PassOut(
        d=torch.empty(n, device=dev, dtype=torch.float32),
        entropy=torch.empty(n, device=dev, dtype=torch.float32),
        basis=torch.empty(n, Hs, device=dev, dtype=torch.float32) if spec.basis else None,
        grad_weight=torch.zeros(V, Hs, device=dev, dtype=torch.float32)
        if spec.grad_weight else None,
        grad_bias=torch.zeros(V, device=dev, dtype=torch.float32) if spec.grad_bias else None,
    )
    if n == 0:
        return out
    # T is a second fp32 (C, V) buffer (and the torch row path's temporaries, _EXTRA_ROWS)
    C = chunk_rows(spec, V, _EXTRA_ROWS[backend], 4, n_size=n, n_rows=n)
    t_buf = torch.empty(C, V, device=dev, dtype=torch.float32)  # (C, V) fp32

    def divergence_chunk(s: int, e: int, S: torch.Tensor, G: torch.Tensor | None) -> None:
        T = mm_f32(g[s:e], wt.t(), out=t_buf[:e - s])  # the teacher's chunk, no bias / τ
        divergence_rows(S, T, b, teacher.c, spec.inv_tau, beta, backend=backend, g_out=G,
                        g_mul=spec.inv_tau, g_scale=None if g_scale is None else g_scale[s:e],
                        out=(out.d[s:e], out.entropy[s:e]))

    chunk_loop(h, ws, spec, out, C, divergence_chunk)
    return out


class _LinearDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, b, teacher: _Teacher, spec: HeadPass, beta, backend, recompute):
        # h (n, Hs), teacher.g (n, Ht): the unmasked rows; spec.basis: build dh's basis now (a
        # frozen head whose hidden states need a gradient); recompute: a trainable weight or bias
        out = _divergence_pass(h, w, b, teacher, spec, beta, backend)
        ctx.beta, ctx.spec, ctx.backend = beta, spec, backend
        ctx.recompute, ctx.hidden_dtype = recompute, h.dtype
        if recompute:
            ctx.save_for_backward(h, w, b, teacher.g, teacher.u, teacher.c)
        else:  # the frozen head needs only the basis: h, g and the weights can be freed
            ctx.save_for_backward(out.basis)
        ctx.mark_non_differentiable(out.entropy)
        ctx.set_materialize_grads(False)
        return out.d, out.entropy

    @staticmethod
    def backward(ctx, g_d, _g_entropy):
        none = (None,) * 5
        if g_d is None:
            return (None, None, None) + none
        if not ctx.recompute:
            (basis,) = ctx.saved_tensors
            if basis is None:
                return (None, None, None) + none
            # dh_n = ḡ_n · basis_n, rounded to the hidden dtype once
            return (basis * g_d.float()[:, None]).to(ctx.hidden_dtype), None, None, *none
        h, w, b, g, u, c = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        spec = HeadPass(inv_tau=ctx.spec.inv_tau, chunk_size=ctx.spec.chunk_size, basis=need_h,
                        grad_weight=need_w, grad_bias=need_b)
        out = _divergence_pass(h, w, b, _Teacher(g, u, c), spec, ctx.beta, ctx.backend,
                               g_scale=g_d.float())
        return (out.basis.to(h.dtype) if need_h else None,
                out.grad_weight.to(w.dtype) if need_w else None,
                out.grad_bias.to(b.dtype) if need_b else None, *none)


def _divergence_autograd(s: torch.Tensor, t: torch.Tensor, beta: float):
    """(D, H) per row of the scaled logits s, t (C, V) fp32, in differentiable torch ops."""
    # z − logsumexp(z), not torch.log_softmax: on CPU its fp32 row sum drifts (8e-6 in every
    # log-prob at V = 128256, 10× logsumexp's error)
    lp = s - torch.logsumexp(s, -1, keepdim=True)
    lq = t - torch.logsumexp(t, -1, keepdim=True)
    p = lp.exp()
    mode = divergence_mode(beta)
    if mode == 0:
        d = (lq.exp() * (lq - lp)).sum(-1)
    elif mode == 1:
        d = (p * (lp - lq)).sum(-1)
    else:
        lm = torch.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))
        d = beta * (lq.exp() * (lq - lm)).sum(-1) + (1.0 - beta) * (p * (lp - lm)).sum(-1)
    return d, -(p * lp).sum(-1)


def _chunked(h, w, b, g, u, c, beta, inv_tau, chunk_size, backend):
    """"chunked" (module docstring): D and H of the rows through `chunked_linear`."""
    if b is not None and b.requires_grad and torch.is_grad_enabled():
        raise ValueError("method='chunked' cannot train student_bias (chunked_linear takes no "
                         "bias); use method='basis'")
    ut = gemm_weight(u, backend).t()
    bs = None if b is None else b.detach().float()
    bt = None if c is None else c.float()

    def fn(z, g_rows):
        s = (z if bs is None else z + bs) * inv_tau
        t = mm_f32(g_rows, ut)  # (C, V) fp32: the teacher's chunk, a constant for autograd
        t = (t if bt is None else t + bt) * inv_tau
        d, ent = _divergence_autograd(s, t, beta)
        return torch.stack([d, ent.detach()], 1)

    n = h.shape[0]
    if n == 0:  # (chunked_linear's empty result has no graph: this one is h's, as "basis"'s)
        return h.float().sum(-1), h.new_zeros(0, dtype=torch.float32)
    chunk = chunk_size or default_chunk_size(w.shape[0], _CHUNKED_ROWS - 1, 4, n_rows=n)
    out = chunked_linear(fn, h, w, g, chunk_size=chunk)  # (n, 2)
    return out[:, 0], out[:, 1].detach()


def _check_pair(who: str, hidden, weight, bias) -> None:
    """grpo_lce._checks.check_head, its message prefixed with whose head it is."""
    try:
        check_head(hidden, weight, bias)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{who}: {e}") from None


def linear_divergence(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    beta: float,
    mask: torch.Tensor | None = None,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    method: str = "basis",
):
    """Per-token divergence between the student's and the teacher's softmax((h @ W.T + b) / τ).

    Equals, in fp32 from logits accumulated in fp32 (never rounded to the input dtype),
    ``D = KL(q‖p)`` (β = 0), ``KL(p‖q)`` (β = 1) or ``β KL(q‖m) + (1−β) KL(p‖m)`` with
    ``m = (1−β) p + β q``, p the student's and q the teacher's distribution: TRL 1.16's
    generalized JSD. No (N, V) logits of either model are allocated.

    Args:
        student_hidden: (..., Hs) float32 / bfloat16 / float16.
        student_weight: (V, Hs), student_hidden's dtype and device.
        teacher_hidden: (..., Ht), student_hidden's leading shape; its own dtype.
        teacher_weight: (V, Ht), teacher_hidden's dtype; same V and device as the student's.
        beta: in [0, 1]; 0 is the forward KL, 1 the reverse KL, anything between the JSD.
        mask: (...) the leading shape, nonzero where the token counts; 0 gives 0 in every
            output and gradient, at no GEMM cost. None keeps every row.
        student_bias, teacher_bias: optional (V,), each in its head's dtype.
        temperature: > 0; both models' logits are divided by it.
        return_entropy: also return the student's per-token entropy (fp32, no gradient).
        chunk_size: rows per chunk; any positive int (default: a 256 MiB budget for the chunk's
            (C, V) buffers, see the module docstring).
        method: "basis" (default) or "chunked": the two implementations of the module docstring.

    Returns:
        D (...) fp32, or (D, entropy) when `return_entropy`. Differentiable with respect to
        student_hidden, student_weight and student_bias for any upstream gradient; the teacher's
        tensors get none.

    One host read a call when `mask` is given (the number of unmasked rows).
    """
    _check_pair("student", student_hidden, student_weight, student_bias)
    _check_pair("teacher", teacher_hidden, teacher_weight, teacher_bias)
    lead = tuple(student_hidden.shape[:-1])
    if tuple(teacher_hidden.shape[:-1]) != lead:
        raise ValueError(
            f"teacher_hidden has leading shape {tuple(teacher_hidden.shape[:-1])} but "
            f"student_hidden has {lead} (shapes {tuple(teacher_hidden.shape)} and "
            f"{tuple(student_hidden.shape)})"
        )
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(
            f"teacher_weight has V={teacher_weight.shape[0]} but student_weight has "
            f"V={student_weight.shape[0]}: the divergence needs one vocabulary"
        )
    if teacher_weight.device != student_weight.device:
        raise ValueError(f"teacher_weight is on {teacher_weight.device} but student_weight is "
                         f"on {student_weight.device}")
    if isinstance(beta, torch.Tensor) or not 0.0 <= float(beta) <= 1.0:
        raise ValueError(f"beta must be a float in [0, 1], got {beta!r}")
    beta = float(beta)
    inv_tau = 1.0 / check_temperature(temperature)
    check_chunk_size(chunk_size)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")

    h = student_hidden.reshape(-1, student_hidden.shape[-1])
    g = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    u = teacher_weight.detach()
    c = None if teacher_bias is None else teacher_bias.detach()
    N = h.shape[0]
    idx = None
    if mask is not None:
        if tuple(mask.shape) != lead:
            raise ValueError(f"mask has shape {tuple(mask.shape)} but the hidden states have "
                             f"leading shape {lead}")
        if mask.device != h.device:
            raise ValueError(f"mask is on {mask.device} but student_hidden is on {h.device}")
        keep = mask.reshape(-1) != 0
        n_keep = int(keep.sum())  # the host read: it sizes every GEMM below
        if n_keep < N:
            idx = torch.nonzero_static(keep, size=n_keep).squeeze(1)
            h, g = h.index_select(0, idx), g.index_select(0, idx)

    backend = decide(h, student_weight, student_bias).backend
    if method == "chunked":
        d, ent = _chunked(h, student_weight, student_bias, g, u, c, beta, inv_tau, chunk_size,
                          backend)
    else:
        grad = torch.is_grad_enabled()
        recompute = grad and (student_weight.requires_grad
                              or (student_bias is not None and student_bias.requires_grad))
        frozen_basis = grad and h.requires_grad and not recompute
        spec = HeadPass(inv_tau=inv_tau, chunk_size=chunk_size, basis=frozen_basis)
        d, ent = _LinearDivergence.apply(h, student_weight, student_bias, _Teacher(g, u, c), spec,
                                         beta, backend, recompute)
    if idx is not None:
        # back to the caller's rows; index_copy's backward hands each row its own gradient
        d = d.new_zeros(N).index_copy(0, idx, d)
        ent = ent.new_zeros(N).index_copy(0, idx, ent)
    d, ent = d.reshape(lead), ent.reshape(lead)
    return (d, ent) if return_entropy else d
