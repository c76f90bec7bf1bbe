"""linear_cross_entropy: the SFT loss from hidden states, without logits, plus TRL's metrics.

h (N, H), W (V, H), b (V,), y (N,);   z = h Wᵀ + b   (chunks of C rows, fp32)
    loss = Σ_n (lse_n − z[n, y_n]) / d       d = #valid ("mean"), 1 ("sum") or num_items
    ∂loss/∂z_n = (p_n − e_{y_n}) / d         known in the forward up to the scalar grad_output

So the forward builds the whole gradient while the chunk is in memory: dh = G W (GEMM 2) and,
for a trainable head, dW = Gᵀ h (GEMM 3); backward only scales them by grad_output. Frozen
head: 2 GEMMs, trainable: 3 (torch eager and torch.compile need 3 plus a recompute or (N, V)).
`reduction="none"` returns −log p per token through linear_logprobs (any upstream gradient).

With `return_metrics`, the same pass also counts argmax == label (`correct`), sums the
per-token entropy (`entropy_sum`) and counts the valid tokens (`num_tokens`): counts, so ranks
can add them before dividing; correct / num_tokens is TRL's mean_token_accuracy and
entropy_sum / num_tokens its entropy.
"""

from __future__ import annotations

import torch

from grpo_lce._checks import check_chunk_size, check_head, check_targets, defer, raise_deferred
from grpo_lce._dispatch import Path, decide
from grpo_lce._head import HeadCall
from grpo_lce._rows import RowPlan, Term, grad_to_caller, plan_rows
from grpo_lce.kernels.scale_cast import scale_cast
from grpo_lce.logprobs import linear_logprobs

_REDUCTIONS = ("mean", "sum", "none")


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, call: HeadCall, divisor, want_metrics: bool):
        # hidden (N, H) the caller's rows; call.plan (_rows.RowPlan) the rows processed, call.y
        # (n,) their labels: with plan.n_valid (the device-counted layout) the rows past it
        # give 0; call.path (_dispatch.Path) how
        plan, y, path = call.plan, call.y, call.path
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        # (n, H); a copy of ours takes the basis's bf16 half (_head's fused loop)
        h, owned = plan.own_rows(hidden)
        n = h.shape[0]
        # α = 1/d per row: G = (p − e_y)/d is ∂loss/∂z. d stays on device (no host read).
        need_grad = need_h or need_w or need_b
        alpha = divisor.reciprocal().expand(n).contiguous() if need_grad else None
        out = call.run(h, scratch=owned, basis=need_h, grad_weight=need_w, grad_bias=need_b,
                       argmax=want_metrics, entropy=want_metrics, alpha=alpha)
        loss = (out.lse - out.z_y).sum() / divisor
        ctx.save_for_backward(out.basis, out.basis_lo, out.grad_weight, out.grad_bias,
                              *plan.saved())
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.n_rows, ctx.n_all, ctx.backend = n, hidden.shape[0], path.backend
        if want_metrics:
            correct = (out.argmax == y).sum()
            entropy_sum = out.entropy.sum()
        else:
            correct = entropy_sum = torch.zeros((), device=h.device)
        ctx.mark_non_differentiable(correct, entropy_sum)
        return loss, correct, entropy_sum

    @staticmethod
    def backward(ctx, g_loss, _g_correct, _g_ent):
        basis, basis_lo, gw, gb, *saved_plan = ctx.saved_tensors
        plan = RowPlan.from_saved(ctx.n_rows, *saved_plan)
        h_dt, w_dt, b_dt = ctx.dtypes
        g = g_loss.float()
        # dh of the caller's rows (0 at the ignored ones), scaled and cast in one pass
        dh = None if basis is None else grad_to_caller(
            plan, Term(basis, g, lo=basis_lo), n_all=ctx.n_all, dtype=h_dt, backend=ctx.backend)
        dw = None if gw is None else scale_cast(gw, g, w_dt, backend=ctx.backend)
        db = None if gb is None else scale_cast(gb, g, b_dt, backend=ctx.backend)
        return dh, dw, db, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items: int | torch.Tensor | None = None,
    return_metrics: bool = False,
    chunk_size: int | None = None,
):
    """Cross-entropy of softmax(hidden @ weight.T + bias) against labels, in fp32, no logits.

    Equals ``F.cross_entropy((hidden @ weight.T + bias).float().flatten(0, -2), labels.flatten(),
    ignore_index=ignore_index, reduction=reduction)``; with `num_items` the summed loss is
    divided by it instead (transformers' ``num_items_in_batch`` for gradient accumulation).
    Labels are used as given: shift them yourself for causal LM (``labels[..., 1:]`` against
    ``hidden[..., :-1, :]``).

    Args:
        hidden (..., H), weight (V, H), labels (...) integer in [0, V) or ignore_index.
        reduction: "mean" (over valid tokens; 0 if there are none), "sum" or "none" (per token,
            0 at ignored positions, fp32).
        num_items: divisor of the summed loss (int or 0-d tensor), replacing the divisor of
            "mean" or "sum"; not allowed with "none".
        return_metrics: also return a dict with `correct` (argmax == label count), `entropy_sum`
            (Σ per-token entropy) and `num_tokens` (valid tokens), all 0-d tensors, computed
            in the same pass ("none" reduction: per-token entropy comes from linear_logprobs).
        chunk_size: rows per chunk (default from a 256 MiB budget).

    Returns:
        loss, or (loss, metrics) with `return_metrics`.
    """
    raise_deferred()
    check_head(hidden, weight, bias)
    check_targets(labels, hidden, weight.shape[0], ignore_index, "labels")
    check_chunk_size(chunk_size)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if num_items is not None and reduction == "none":
        raise ValueError("num_items divides a summed loss; it makes no sense with reduction='none'")

    if reduction == "none":
        logp, ent = linear_logprobs(
            hidden, weight, labels, bias=bias, ignore_index=ignore_index,
            return_entropy=True, chunk_size=chunk_size,
        )
        loss = -logp
        if not return_metrics:
            return loss
        metrics = {
            "correct": _argmax_correct(hidden, weight, bias, labels, ignore_index, chunk_size),
            "entropy_sum": ent.detach().sum(),
            "num_tokens": (labels != ignore_index).sum(),
        }
        return loss, metrics

    h, y, plan, path = _rows_and_labels(hidden, weight, bias, labels, ignore_index)
    n_valid = plan.n if plan.n_valid is None else plan.n_valid.reshape(())
    divisor = _divisor(reduction, num_items, n_valid, hidden.device)
    call = HeadCall(plan, y, weight, bias, path, chunk_size=chunk_size)
    loss, correct, entropy_sum = _LinearCrossEntropy.apply(h, weight, bias, call, divisor,
                                                           bool(return_metrics))
    if plan.n_bad is not None:  # a target out of range (reported by a later call): NaN
        loss = torch.where(plan.n_bad > 0, float("nan"), loss)
    defer(plan.n_bad, plan.bad_message)
    if not return_metrics:
        return loss
    # torch.full, not torch.tensor: a host value copied to the GPU makes the host wait
    num_tokens = (torch.full((), n_valid, device=hidden.device) if plan.n_valid is None
                  else n_valid.long())
    return loss, {"correct": correct, "entropy_sum": entropy_sum, "num_tokens": num_tokens}


def _divisor(reduction, num_items, n_valid, device) -> torch.Tensor:
    """The loss divisor as a 0-d fp32 tensor on device (a tensor num_items or n_valid is never
    read back)."""
    if num_items is not None:
        if isinstance(num_items, torch.Tensor):
            return num_items.detach().to(device=device, dtype=torch.float32).reshape(())
        if num_items <= 0:
            raise ValueError(f"num_items must be > 0, got {num_items}")
        return torch.full((), float(num_items), device=device)
    if reduction == "sum":
        return torch.ones((), device=device)
    # mean over no valid token: the sum is 0, divide by 1 so the loss is 0, never nan
    if isinstance(n_valid, torch.Tensor):
        return n_valid.clamp_min(1).float()
    return torch.full((), float(max(n_valid, 1)), device=device)


def _rows_and_labels(hidden, weight, bias, labels, ignore_index
                     ) -> tuple[torch.Tensor, torch.Tensor, RowPlan, Path]:
    """(h (N, H), y (n,) int64, plan, path): the caller's rows flattened, the labels of the rows
    the chunk loop processes, which rows those are (grpo_lce._rows; `plan.rows(h)` gives them),
    and the call's path (grpo_lce._dispatch)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    path = decide(h, weight, bias)
    plan, y = plan_rows(labels.reshape(-1), weight.shape[0], ignore_index, "labels", path)
    return h, y, plan, path


def _argmax_correct(hidden, weight, bias, labels, ignore_index, chunk_size) -> torch.Tensor:
    """argmax == label count for reduction='none': a second, no-grad pass of the chunk loop (its
    own path and rows; rows past the valid ones have argmax −1 against label 0, so they never
    count)."""
    weight, bias = weight.detach(), None if bias is None else bias.detach()
    h, y, plan, path = _rows_and_labels(hidden.detach(), weight, bias, labels, ignore_index)
    call = HeadCall(plan, y, weight, bias, path, chunk_size=chunk_size)
    return (call.run(plan.rows(h), argmax=True, entropy=False).argmax == y).sum()
