"""chunked_linear with several losses against the same function on full fp64 logits.

Each `fn` is plain torch; nothing about its derivative is written anywhere. Run:
    python -m pytest tests/test_chunked.py -q
"""

import pytest
import torch
import torch.nn.functional as F

from grpo_lce import chunked_linear
from _tolerance import EPS32, K_REORDERED, assert_3way, assert_within, ce_bound

N, H, V = 45, 16, 203


def ce(z, y):  # scalar: sums over its rows
    return F.cross_entropy(z, y, reduction="sum")


def mse_one_hot(z, y):  # per row
    return ((z.softmax(-1) - F.one_hot(y, z.shape[-1]).to(z.dtype)) ** 2).sum(-1)


def kl_to_teacher(z, teacher_logp):  # per row: KL(teacher || student)
    return (teacher_logp.exp() * (teacher_logp - z.log_softmax(-1))).sum(-1)


def z_loss(z):  # scalar
    return (torch.logsumexp(z, -1) ** 2).sum()


def advantage_logp(z, y, adv):  # per row: the GRPO surrogate's numerator
    return adv * z.log_softmax(-1).gather(-1, y[:, None]).squeeze(-1)


def _args(name, g):
    y = torch.randint(0, V, (N,), generator=g)
    if name == "kl":
        return (torch.randn(N, V, generator=g).log_softmax(-1),)
    if name == "zloss":
        return ()
    if name == "adv":
        return (y, torch.randn(N, generator=g))
    return (y,)


FNS = {"ce": ce, "mse": mse_one_hot, "kl": kl_to_teacher, "zloss": z_loss, "adv": advantage_logp}


@pytest.mark.parametrize("name", list(FNS))
@pytest.mark.parametrize("chunk_size", [1, 8, None])
@pytest.mark.parametrize("train_head", [False, True], ids=["frozenW", "trainW"])
def test_matches_full_logits(name, chunk_size, train_head):
    fn = FNS[name]
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) / H**0.5).requires_grad_(train_head)
    args = _args(name, g)
    out = chunked_linear(fn, h, w, *args, chunk_size=chunk_size)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    args64 = tuple(a.double() if a.is_floating_point() else a for a in args)
    ref = fn(h64 @ w64.t(), *args64)
    assert out.shape == ref.shape
    # fn is arbitrary, so the noise floor is fn itself on full fp32 logits (plain torch): the
    # same fp32 operations, rows in other chunks and the dW sum over N in another order, so
    # within K_REORDERED of its error against fp64, plus 4 ulp of the largest value.
    h32, w32 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out32 = fn(h32 @ w32.t(), *args)
    assert_3way(out, out32, ref, k=K_REORDERED, atol=4 * EPS32 * ref.abs().max().item(),
                what=f"{name} value")
    up = torch.randn(out.shape, generator=g)
    (out * up).sum().backward()
    (out32 * up).sum().backward()
    (ref * up.double()).sum().backward()
    pairs = [("hidden", h, h32, h64), ("weight", w, w32, w64)][:2 if train_head else 1]
    for what, t, t32, t64 in pairs:
        assert_3way(t.grad, t32.grad, t64.grad, k=K_REORDERED,
                    atol=4 * EPS32 * t64.grad.abs().max().item(), what=f"{name} d {what}")


def test_bf16_inputs_get_fp32_logits_and_3d_shape():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 7, H, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, H, generator=g) / H**0.5).bfloat16()
    y = torch.randint(0, V, (2, 7), generator=g)
    seen = []

    def fn(z, yy):
        seen.append(z.dtype)
        return -z.log_softmax(-1).gather(-1, yy[:, None]).squeeze(-1)

    out = chunked_linear(fn, h, w, y, chunk_size=3)
    assert out.shape == (2, 7) and out.dtype == torch.float32 and set(seen) == {torch.float32}
    ref = F.cross_entropy((h.double() @ w.double().t()).flatten(0, 1), y.flatten(), reduction="none")
    # fp32 logits of the bf16 values: tests/_tolerance.py's per-row cross-entropy bound
    bound = ce_bound(h.detach().flatten(0, 1), w, None, y.flatten(), reduction="none")
    assert_within(out.flatten(), ref, bound, what="bf16 per-row CE")
    out.sum().backward()
    assert h.grad.dtype == torch.bfloat16 and h.grad.shape == h.shape


def test_bad_fn_output_is_a_clear_error():
    with pytest.raises(ValueError, match="per-row tensor of leading size"):
        chunked_linear(lambda z: z.sum(0), torch.randn(10, H), torch.randn(V, H), chunk_size=4)
    with pytest.raises(TypeError, match="fn must return a tensor"):
        chunked_linear(lambda z: 1.0, torch.randn(10, H), torch.randn(V, H))
    with pytest.raises(ValueError, match=r"row_args\[0\] has shape"):
        chunked_linear(ce, torch.randn(10, H), torch.randn(V, H), torch.zeros(9, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size must be > 0"):
        chunked_linear(ce, torch.randn(10, H), torch.randn(V, H), torch.zeros(10, dtype=torch.long),
                       chunk_size=-2)


@pytest.mark.parametrize("name", ["ce", "mse"])  # a scalar fn and a per-row one
@pytest.mark.parametrize("train_head", [False, True], ids=["frozenW", "trainW"])
def test_zero_rows_backpropagate_zero_gradients(name, train_head):
    # an all-masked micro-batch: the loss is 0 (or an empty per-row tensor), and backward
    # must give every input a zero gradient rather than fail for want of a graph
    h = torch.randn(2, 0, H, requires_grad=True)
    w = (torch.randn(V, H) / H**0.5).requires_grad_(train_head)
    y = torch.zeros(2, 0, dtype=torch.long)
    out = chunked_linear(FNS[name], h, w, y)
    assert out.shape == ((2, 0) if name == "mse" else ())
    assert out.requires_grad and (out.sum() == 0)
    out.sum().backward()
    assert h.grad is not None and h.grad.shape == h.shape
    if train_head:
        assert w.grad is not None and torch.count_nonzero(w.grad) == 0
    with torch.no_grad():  # no graph asked for: none made
        assert not chunked_linear(FNS[name], h, w, y).requires_grad
