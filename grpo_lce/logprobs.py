"""linear_logprobs: per-token log p(target) (and entropy) from hidden states, without logits.

h (N, H), W (V, H), b (V,), y (N,), τ;   z = (h Wᵀ + b) / τ   (chunks of C rows, fp32)
    logp_n = z[n, y_n] − lse_n            H_n = lse_n − Σ_v p_nv z_nv
    ∂logp_n/∂h_n = −(G_n W) / τ,   G_n = p_n − e_{y_n}      (the gradient basis, built in forward)
    ∂H_n/∂h_n    = −(E_n W) / τ,   E_n = p_n ∘ (z_n − z̄_n)
    argmax_n     = the first v with z[n, v] = max_v z[n, v]       (optional; no gradient)

Frozen head (weight.requires_grad False: LoRA / QLoRA), the main case: the forward computes
GEMM 1 (z) and GEMM 2 (the basis G W) chunk by chunk and keeps only the (N, H) basis; the
backward is elementwise, dh_n = −(g_n · basis_n + g^H_n · ebasis_n) / τ, for ANY upstream
gradients g (log-probs) and g^H (entropy). 2 GEMMs in all; one more for the entropy basis when
`entropy_requires_grad=True` (otherwise an entropy gradient, if one arrives, is recomputed in
backward: 2 more GEMMs, still exact).

Trainable head or bias: dW = Σ_n Dᵀ h needs the upstream gradient inside the sum, so backward
recomputes each chunk with D = −(g (p − e_y) + g^H p∘(z − z̄)) / τ: 4 GEMMs in all.
Extra memory: one chunk (see grpo_lce._chunks) plus the (n, H) basis of the n processed rows
(the valid ones, or all N in the device-counted layout of grpo_lce._rows, where the rows are
also gathered once into valid-first order). The basis is fp32, except on the fused path
(Hopper, bf16): 3 bytes a value (kernels/split_float), and for a frozen head its bf16 half is
written over the gathered rows chunk by chunk (grpo_lce._head), so the forward holds
3 N H bytes besides one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_lce._checks import (
    check_chunk_size,
    check_head,
    check_targets,
    check_temperature,
    defer,
    raise_deferred,
)
from grpo_lce._dispatch import decide
from grpo_lce._head import HeadCall
from grpo_lce._rows import (
    RowPlan,
    Term,
    grad_to_caller,
    indices_to_caller,
    plan_rows,
    values_to_caller,
)


@dataclass(frozen=True)
class _Wants:
    """What a linear_logprobs call returns besides logp, and whether the forward builds the
    entropy's gradient basis."""

    entropy: bool = False
    argmax: bool = False
    entropy_basis: bool = False


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, call: HeadCall, wants: _Wants):
        # hidden (N, H) all rows; call.plan (_rows.RowPlan) the rows processed, call.y (n,)
        # their targets; call.path (_dispatch.Path) how
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        recompute = need_w or need_b
        plan = call.plan
        # rows of our own (a copy): the fused path writes the basis's bf16 half over them
        rows, owned = plan.own_rows(hidden)
        out = call.run(rows, scratch=owned, basis=need_h and not recompute,
                       ebasis=need_h and not recompute and wants.entropy_basis,
                       entropy=wants.entropy, argmax=wants.argmax)
        del rows  # (held by out.basis when the basis went over it)
        ctx.call, ctx.recompute = call.saved(), recompute
        ctx.n_rows, ctx.count = plan.n, plan.count
        # The frozen path needs only the (n, H) bases. `hidden` is the caller's tensor (no copy),
        # kept for a recompute: a trainable head, or an entropy gradient without its basis.
        ctx.save_for_backward(hidden, weight, bias, call.y, out.basis, out.basis_lo, out.ebasis,
                              *plan.saved())
        ctx.set_materialize_grads(False)
        N = hidden.shape[0]
        # without return_entropy the caller never sees the second output (its value is 0)
        ent = out.lse.new_zeros(out.lse.shape) if out.entropy is None else out.entropy
        # the argmax rides on the same pass (read off the row maxima GEMM 1 already finds);
        # an integer output, so autograd never sends it a gradient
        amax = indices_to_caller(plan, out.argmax, N) if wants.argmax else None
        return (values_to_caller(plan, out.z_y - out.lse, N),
                values_to_caller(plan, ent, N), amax)

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g_argmax):
        hidden, weight, bias, y, basis, basis_lo, ebasis, *saved_plan = ctx.saved_tensors
        plan = RowPlan.from_saved(ctx.n_rows, *saved_plan, count=ctx.count)
        call = ctx.call.restored(plan, y, weight, bias)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None, None)
        if g_logp is None and g_ent is None:
            return (None, None, None) + none
        s = -call.inv_tau
        to_caller = {"n_all": hidden.shape[0], "dtype": hidden.dtype,
                     "backend": call.path.backend}
        if ctx.recompute:
            # per processed row: α = −g/τ, β = −g^H/τ (upstream gradients of logp and entropy);
            # 0 past the valid rows of the device-counted layout
            alpha = None if g_logp is None else plan.rows(g_logp).float() * s
            beta = None if g_ent is None else plan.rows(g_ent).float() * s
            # D = α (p − e_y) + β p∘(z − z̄) is the whole ∂loss/∂(h Wᵀ) of a chunk
            out = call.run(plan.rows(hidden), basis=need_h, grad_weight=need_w,
                           grad_bias=need_b,
                           alpha=torch.zeros_like(y, dtype=torch.float32) if alpha is None
                           else alpha, beta=beta)
            dh = grad_to_caller(plan, Term(out.basis, lo=out.basis_lo),
                                **to_caller) if need_h else None
            dw = out.grad_weight.to(weight.dtype) if need_w else None
            db = out.grad_bias.to(bias.dtype) if need_b else None
            return (dh, dw, db) + none
        # Frozen head: elementwise, dh = α · GW + β · EW (scaled, cast and put back in the
        # caller's row order in one pass)
        if g_ent is not None and ebasis is None:
            ebasis = call.run(plan.rows(hidden), ebasis=True).ebasis
        if g_logp is None:
            dh = grad_to_caller(plan, Term(ebasis, g_ent, s), **to_caller)
        else:
            dh = grad_to_caller(plan, Term(basis, g_logp, s, lo=basis_lo),
                                None if g_ent is None else Term(ebasis, g_ent, s), **to_caller)
        return (dh, None, None) + none


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int | None = -100,
    return_entropy: bool = False,
    entropy_requires_grad: bool = False,
    return_argmax: bool = False,
    chunk_size: int | None = None,
):
    """Per-token log p(target) under softmax((hidden @ weight.T + bias) / temperature), in fp32.

    Equals ``log_softmax((hidden @ weight.T + bias).float() / temperature, -1)`` gathered at
    ``targets`` (computed with fp32 accumulation, logits never rounded), without allocating the
    (N, V) logits: rows go through in chunks of `chunk_size` (default: a 256 MiB budget, see
    ``grpo_lce.default_chunk_size``).

    Args:
        hidden: (..., H) float32 / bfloat16 / float16.
        weight: (V, H), same dtype and device as hidden.
        targets: (...) integer, hidden's leading shape; values in [0, V) or `ignore_index`.
        bias: optional (V,).
        temperature: > 0; the logits are divided by it (as TRL does before log_softmax).
        ignore_index: targets equal to it are dropped before any GEMM and give 0 (log-prob and
            entropy). ``None`` keeps every row.
        return_entropy: also return the per-token entropy of the softmax (fp32, 0 at ignored).
        entropy_requires_grad: build the entropy's gradient basis in the forward (one more
            GEMM). Without it an entropy gradient is still exact, recomputed in backward.
        return_argmax: also return the index of the largest logit of each row (int64, the
            first one on a tie, as ``torch.argmax``; −1 at ignored rows), found in the same
            pass: ``argmax == targets`` is TRL's "the target is the top-1 token". No extra GEMM.
        chunk_size: rows per chunk; any positive int.

    Returns:
        logp (...) fp32, followed by entropy (...) fp32 when `return_entropy` and argmax (...)
        int64 when `return_argmax`, as a tuple when either is asked for: `logp`,
        `(logp, entropy)`, `(logp, argmax)` or `(logp, entropy, argmax)`. Differentiable with
        respect to hidden, weight and bias for any upstream gradient on logp and entropy.

    No host synchronisation on the fused path (bf16 on Hopper or newer, frozen head): ignored
    rows are moved after the valid ones and the kernels read their number on the device; a
    target out of range there gives NaN and a ValueError from a later call (grpo_lce._checks).
    A trainable weight takes the same layout, and its backward reads that number on the host
    (long copied by then) to size the cuBLAS GEMMs. Otherwise one host read per call in the
    forward (the number of valid rows sizes the GEMMs).
    """
    raise_deferred()
    check_head(hidden, weight, bias)
    check_targets(targets, hidden, weight.shape[0], ignore_index, "targets")
    inv_tau = 1.0 / check_temperature(temperature)
    check_chunk_size(chunk_size)

    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    path = decide(h, weight, bias, entropy_basis=bool(entropy_requires_grad))
    plan, y = plan_rows(targets.reshape(-1), weight.shape[0], ignore_index, "targets", path)
    call = HeadCall(plan, y, weight, bias, path, inv_tau, chunk_size)
    wants = _Wants(entropy=bool(return_entropy), argmax=bool(return_argmax),
                   entropy_basis=bool(entropy_requires_grad))
    logp, ent, amax = _LinearLogprobs.apply(h, weight, bias, call, wants)
    defer(plan.n_bad, plan.bad_message)
    out = (logp.reshape(lead),)
    if return_entropy:
        out += (ent.reshape(lead),)
    if return_argmax:
        out += (amax.reshape(lead),)
    return out if len(out) > 1 else out[0]
