"""linear_cross_entropy against the fp64 reference: reductions, num_items, metrics, gradients.

Run: python -m pytest tests/test_cross_entropy.py -q
"""

import pytest
import torch

from grpo_lce import linear_cross_entropy
from grpo_lce.reference import cross_entropy_ref, token_metrics_ref
from _head_inputs import head_inputs
from _tolerance import (EPS32, assert_head_grad, assert_within, ce_bound,
                        head_grad_bounds, head_value_bounds, sum_bound)

# Losses and gradients: fp32 logits whatever the input dtype, so tests/_tolerance.py's bounds
# from the sum lengths and magnitudes (ce_bound, head_grad_bounds; bf16 gradients add the bf16
# rounding of G and of the result).


_inputs = head_inputs


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("train_head", [False, True], ids=["frozenW", "trainW"])
def test_loss_grads_metrics(reduction, dtype, backend, train_head, dispatch_override):
    dispatch_override(backend=backend)
    N, H, V = 41, 24, 1031
    h, w, b, y = _inputs(N, H, V, dtype, True, 7)
    h.requires_grad_()
    w.requires_grad_(train_head)
    b.requires_grad_(train_head)
    loss, m = linear_cross_entropy(h, w, y, bias=b, reduction=reduction, return_metrics=True,
                                   chunk_size=16)
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (h, w, b))
    ref = cross_entropy_ref(h64, w64, y, bias=b64, reduction=reduction)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_within(loss, ref, ce_bound(h, w, b, y, reduction=reduction), what="loss")
    valid = y != -100
    n_valid = int(valid.sum())
    vb = head_value_bounds(h, w, b, tau=1.0)

    correct, ent_sum, n_tok = token_metrics_ref(h64.detach(), w64.detach(), y, bias=b64.detach())
    assert int(m["correct"]) == int(correct)
    assert int(m["num_tokens"]) == int(n_tok) == N - 7
    assert_within(m["entropy_sum"], ent_sum,
                  (vb["entropy"] * valid).sum() + sum_bound(N, ent_sum.abs().item()),
                  what="entropy sum")

    up = torch.randn(N) if reduction == "none" else torch.tensor(1.7)
    (loss * up).sum().backward()
    (ref * up.double()).sum().backward()
    grads = [("hidden", h, h64), ("weight", w, w64), ("bias", b, b64)][:3 if train_head else 1]
    # d loss / d log p[y] = -up (/ n_valid for the mean); bf16: G enters the GEMMs in bf16
    a = -up.double() / (n_valid if reduction == "mean" else 1)
    bounds = head_grad_bounds(h, w, b, y, tau=1.0, a=a,
                              operand_rel=0.0 if dtype == torch.float32 else 2.0**-8)
    for name, t, t64 in grads:
        assert_head_grad(t.grad, t64.grad, bounds[name[0]], what=f"d {name}")


def test_num_items_gradient_accumulation():
    """Two micro-batches each divided by the global token count add up to the full-batch mean."""
    h, w, _, y = _inputs(40, 16, 300, torch.float32, False, 9)
    w.requires_grad_()
    n_total = int((y != -100).sum())
    full = linear_cross_entropy(h, w, y)
    full.backward()
    g_full = w.grad.clone()
    w.grad = None
    parts = [linear_cross_entropy(h[s:s + 20], w, y[s:s + 20], num_items=torch.tensor(n_total))
             for s in (0, 20)]
    sum(parts).backward()
    # two fp32 evaluations of one mean, each within its bound of fp64: 2x apart at most
    loss_tol = 2 * ce_bound(h, w, None, y)
    assert_within(sum(parts), full, loss_tol, what="sum of micro-batch losses")
    bounds = head_grad_bounds(h, w, None, y, tau=1.0, a=-1.0 / n_total)
    assert_within(w.grad, g_full, 2 * bounds["w"] + 2 * EPS32 * g_full.abs(),
                  what="d weight, micro-batches")
    as_int = linear_cross_entropy(h, w, y, num_items=n_total, reduction="sum")
    assert_within(as_int, full, loss_tol, what="num_items as an int")


def test_all_ignored_is_zero_not_nan():
    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    y = torch.full((6,), -100)
    loss, m = linear_cross_entropy(h, w, y, return_metrics=True)
    assert loss.item() == 0.0 and int(m["num_tokens"]) == 0
    loss.backward()
    assert torch.all(h.grad == 0) and torch.all(w.grad == 0)


def test_3d_shifted_labels_match_torch_cross_entropy():
    """The causal-LM use: hidden[:, :-1] against labels[:, 1:], as F.cross_entropy sees it."""
    B, T, H, V = 3, 11, 16, 97
    hidden = torch.randn(B, T, H, dtype=torch.float64)
    w = torch.randn(V, H, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T))
    labels[:, :4] = -100
    hidden32 = hidden.float()
    ours = linear_cross_entropy(hidden32[:, :-1], w.float(), labels[:, 1:])
    ref = torch.nn.functional.cross_entropy((hidden[:, :-1] @ w.t()).flatten(0, 1),
                                            labels[:, 1:].flatten(), ignore_index=-100)
    assert_within(ours, ref, ce_bound(hidden[:, :-1].flatten(0, 1), w, None,
                                      labels[:, 1:].flatten()), what="shifted CE")


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(reduction="avg"), ValueError, "reduction must be one of"),
        (dict(reduction="none", num_items=3), ValueError, "num_items"),
        (dict(num_items=0), ValueError, "num_items must be > 0"),
        (dict(labels=torch.tensor([0, 50, 1, 2])), ValueError, r"labels contains 50"),
        (dict(labels=torch.tensor([0, 1])), ValueError, r"labels has shape \(2,\)"),
    ],
)
def test_bad_input(kwargs, exc, match):
    args = dict(labels=torch.tensor([0, 1, 2, -100]))
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), args.pop("labels"), **args)
