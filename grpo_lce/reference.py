"""Slow exact references in fp64, for tests and benchmarks. They materialize (N, V) logits.

Each equals its fast counterpart by definition: logits z = (h Wᵀ + b) / τ computed in fp64 from
the inputs as given (bf16 inputs are exact in fp64), then log_softmax.
"""

from __future__ import annotations

import math

import torch


def logits_ref(hidden, weight, bias=None, temperature=1.0) -> torch.Tensor:
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    return z / temperature


def logprobs_ref(hidden, weight, targets, *, bias=None, temperature=1.0, ignore_index=-100):
    """(logp, entropy) in fp64 with the leading shape of targets; 0 at ignored positions."""
    z = logits_ref(hidden, weight, bias, temperature)
    logp_all = torch.log_softmax(z, dim=-1)
    if ignore_index is None:
        valid = torch.ones_like(targets, dtype=torch.bool)
    else:
        valid = targets != ignore_index
    y = torch.where(valid, targets, torch.zeros_like(targets))
    logp = logp_all.gather(-1, y.unsqueeze(-1).long()).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros((), dtype=torch.float64, device=z.device)
    return torch.where(valid, logp, zero), torch.where(valid, ent, zero)


def cross_entropy_ref(
    hidden, weight, labels, *, bias=None, ignore_index=-100, reduction="mean", num_items=None
):
    """fp64 cross-entropy with the same reduction / num_items semantics as linear_cross_entropy."""
    logp, _ = logprobs_ref(hidden, weight, labels, bias=bias, ignore_index=ignore_index)
    nll = -logp
    if reduction == "none":
        return nll
    total = nll.sum()
    if num_items is not None:
        return total / float(num_items)
    if reduction == "sum":
        return total
    return total / max(int((labels != ignore_index).sum()), 1)


def token_metrics_ref(hidden, weight, labels, *, bias=None, ignore_index=-100):
    """(correct argmax count, entropy sum, valid count) in fp64."""
    z = logits_ref(hidden, weight, bias)
    valid = labels != ignore_index
    correct = ((z.argmax(-1) == labels) & valid).sum()
    _, ent = logprobs_ref(hidden, weight, labels, bias=bias, ignore_index=ignore_index)
    return correct, ent.sum(), valid.sum()


def divergence_of_logprobs(lp: torch.Tensor, lq: torch.Tensor, beta: float) -> torch.Tensor:
    """D per row from the student's and the teacher's log-probabilities over the last dim, in
    their dtype: KL(q‖p) at β = 0, KL(p‖q) at β = 1, else β KL(q‖m) + (1−β) KL(p‖m) with
    log m = logaddexp(log p + log(1−β), log q + log β)."""
    p, q = lp.exp(), lq.exp()
    if beta == 0.0:
        return (q * (lq - lp)).sum(-1)
    if beta == 1.0:
        return (p * (lp - lq)).sum(-1)
    lm = torch.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))
    return beta * (q * (lq - lm)).sum(-1) + (1.0 - beta) * (p * (lp - lm)).sum(-1)


def divergence_ref(student_hidden, student_weight, teacher_hidden, teacher_weight, *, beta,
                   mask=None, student_bias=None, teacher_bias=None, temperature=1.0):
    """(D, student entropy) in fp64 with the hidden states' leading shape, 0 where mask is 0:
    KL(q‖p) at β = 0, KL(p‖q) at β = 1, else β KL(q‖m) + (1−β) KL(p‖m) with m = (1−β) p + β q
    (p student, q teacher; grpo_lce.divergence). Differentiable in fp64 autograd."""
    lp = torch.log_softmax(logits_ref(student_hidden, student_weight, student_bias, temperature),
                           -1)
    lq = torch.log_softmax(logits_ref(teacher_hidden, teacher_weight, teacher_bias, temperature),
                           -1)
    d = divergence_of_logprobs(lp, lq, beta)
    ent = -(lp.exp() * lp).sum(-1)
    if mask is not None:
        zero = torch.zeros((), dtype=torch.float64, device=d.device)
        d, ent = torch.where(mask != 0, d, zero), torch.where(mask != 0, ent, zero)
    return d, ent


def sample_logprobs_ref(hidden, weight, *, bias=None, temperature=1.0, top_k=None, top_p=None,
                        min_p=None) -> torch.Tensor:
    """(N, V) fp64 log-probabilities of the distribution grpo_lce.linear_sample draws from:
    softmax of the fp64 logits at τ (1 for τ = 0, greedy) truncated to the kept set
    {z ≥ max(t_k, t_p, t_min)} and renormalized; −inf outside it (grpo_lce.sample)."""
    tau = 1.0 if temperature == 0 else temperature
    z = logits_ref(hidden.reshape(-1, hidden.shape[-1]), weight, bias, tau)
    V = z.shape[-1]
    t = torch.full(z.shape[:1], float("-inf"), dtype=torch.float64, device=z.device)
    if top_k is not None and top_k < V:
        t = z.topk(top_k, dim=-1).values[:, -1]
    if top_p is not None and top_p < 1.0:
        zk = torch.where(z >= t[:, None], z, float("-inf"))
        desc = zk.sort(-1, descending=True).values
        cum = torch.softmax(desc, -1).cumsum(-1)
        j = (cum < top_p).sum(-1, keepdim=True).clamp_max(V - 1)
        t = torch.maximum(t, desc.gather(-1, j).squeeze(-1))
    if min_p is not None and min_p > 0.0:
        t = torch.maximum(t, z.amax(-1) + math.log(min_p))
    return torch.log_softmax(torch.where(z >= t[:, None], z, float("-inf")), -1)
