"""linear_logprobs against the fp64 reference: values, entropies, gradients and the argmax.

Covers dtype (fp32, bf16) × ragged shapes × real vocabularies (50257, 151936 at small N) ×
temperature × bias × ignored rows × which inputs require grad, on both backends: the torch
fallback and the Triton row kernel (under TRITON_INTERPRET=1 on CPU); `return_argmax` on both
backends, the fused path and the device-counted row layout, with exact ties. Run:
    python -m pytest tests/test_logprobs.py -q
"""

import pytest
import torch

from grpo_lce import default_chunk_size, linear_logprobs
from grpo_lce._dispatch import recording
from grpo_lce.reference import logprobs_ref
from _head_inputs import head_inputs
from _tolerance import (EPS32, assert_3way, assert_head_grad, assert_within,
                        head_grad_bounds, head_value_bounds)

# Log-probs and entropies are computed from fp32 logits whatever the input dtype, so the error
# against fp64 is fp32 rounding of an H-term dot product and a V-term sum: tests/_tolerance.py's
# head_value_bounds per row in test_values_and_grads. Elsewhere (H <= 64, logits O(3), so
# sum_bound(64, 20) ~ 8e-5 per logit at 4σ): 5e-5, as typical errors are ~1e-6 at these sizes.
# The bf16-logit path torch users run today is ~1e-2 off (checked below).
VALUE_ATOL = 5e-5
# Gradients: GEMM rounding over V (dh) or N (dW) terms, bounded elementwise by head_grad_bounds
# (sum lengths and |G| |W| magnitudes); in bf16 G and the entropy basis enter the GEMMs rounded
# to bf16 (2^-9 each, operand_rel 2^-8) and dh returns in bf16. The entropy basis Σ p (z − z̄) w
# cancels between tokens above and below z̄, which the bound's |G'| magnitudes account for.

# (N, H, V, temperature, with_bias, n_ignored): ragged N (1 and odd), H not a power of two,
# vocabularies of real tokenizers (GPT-2 50257, Qwen2 151936) at small N so fp64 fits.
CASES = [
    (1, 16, 101, 1.0, False, 0),
    (37, 24, 257, 0.7, True, 5),
    (23, 32, 50257, 1.0, False, 3),
    (5, 16, 151936, 1.3, True, 1),
]
BACKENDS = ["torch", "triton"]


def _grid():
    """case × dtype × backend × train_head (ids as the stacked parametrize would give them).

    bf16 under the Triton backend runs the fused GEMM in Triton's interpreter on CPU, tile by
    tile: at the real vocabularies that takes minutes, so those cases are marked `slow` (CI runs
    them in a second, time-boxed pytest call; on a GPU they take milliseconds)."""
    for train_head in (False, True):
        for case in CASES:
            for dtype, dname in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                for backend in BACKENDS:
                    slow = backend == "triton" and dtype == torch.bfloat16 and case[2] > 10_000
                    yield pytest.param(
                        case, dtype, backend, train_head,
                        marks=[pytest.mark.slow] if slow else [],
                        id=f"{'trainW' if train_head else 'frozenW'}-N{case[0]}-H{case[1]}-"
                           f"V{case[2]}-{dname}-{backend}",
                    )


_inputs = head_inputs


def _torch_same_dtype(h, w, b, y, tau):
    """What a torch user computes today: logits in the input dtype, then fp32 log_softmax."""
    z = h @ w.t()
    if b is not None:
        z = z + b
    logp_all = torch.log_softmax(z.float() / tau, -1)
    valid = y != -100
    lp = logp_all.gather(-1, y.clamp(min=0)[:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


@pytest.mark.parametrize("case, dtype, backend, train_head", list(_grid()))
def test_values_and_grads(case, dtype, backend, train_head, dispatch_override):
    dispatch_override(backend=backend)
    N, H, V, tau, with_bias, n_ign = case
    if backend == "triton" and V > 60000 and train_head:
        pytest.skip("interpreter: the trainable-head recompute at V=151936 is covered by torch")
    h, w, b, y = _inputs(N, H, V, dtype, with_bias, n_ign)
    h.requires_grad_(True)
    w.requires_grad_(train_head)
    if b is not None:
        b.requires_grad_(train_head)

    logp, ent = linear_logprobs(h, w, y, bias=b, temperature=tau, return_entropy=True)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == (N,)

    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    rlogp, rent = logprobs_ref(h64, w64, y, bias=b64, temperature=tau)
    vb = head_value_bounds(h, w, b, tau=tau)  # fp32 logits of the inputs' values, any dtype
    assert_within(logp, rlogp, vb["logp"], what="logp")
    assert_within(ent, rent, vb["entropy"], what="entropy")
    valid = y != -100
    assert torch.all(logp[~valid] == 0) and torch.all(ent[~valid] == 0)

    # GRPO weights every token differently and adds an entropy term: random upstream gradients
    gen = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    (logp * g_lp + ent * g_ent).sum().backward()
    (rlogp * g_lp.double() + rent * g_ent.double()).sum().backward()
    assert h.grad.dtype == dtype
    if train_head:
        assert w.grad.dtype == dtype
    grads = [("hidden", h, h64), ("weight", w, w64), ("bias", b, b64)][:3 if train_head else 1]
    # rounding from the sum lengths and magnitudes; bf16: G and the entropy basis enter the
    # GEMMs in bf16 (operand_rel 2^-8) and the gradient returns in bf16
    bounds = head_grad_bounds(h, w, b, y, tau=tau, a=g_lp, e=g_ent,
                              operand_rel=0.0 if dtype == torch.float32 else 2.0**-8)
    for name, t, t64 in grads:
        if t is not None:
            assert_head_grad(t.grad, t64.grad, bounds[name[0]], what=f"d {name}")
    if dtype == torch.bfloat16:
        ht = h.detach().clone().requires_grad_()
        tl, te = _torch_same_dtype(ht, w.detach(), None if b is None else b.detach(), y, tau)
        (tl * g_lp + te * g_ent).sum().backward()
        scale = h64.grad.abs().max().item()
        assert_3way(h.grad, ht.grad, h64.grad, k=1.0, atol=4e-3 * scale, what="d hidden vs torch")


@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_basis_hint_gives_same_gradient(backend, dispatch_override):
    """entropy_requires_grad only moves the entropy basis GEMM into the forward."""
    dispatch_override(backend=backend)
    h, w, b, y = _inputs(29, 24, 300, torch.float32, True, 4)
    g = torch.randn(29)
    grads = []
    for hint in (False, True):
        hh = h.clone().requires_grad_()
        lp, ent = linear_logprobs(hh, w, y, bias=b, return_entropy=True,
                                  entropy_requires_grad=hint, chunk_size=8)
        (ent * g + lp).sum().backward()
        grads.append(hh.grad)
    # two fp32 evaluations of one gradient, each within head_grad_bounds of fp64
    bound = head_grad_bounds(h, w, b, y, tau=1.0, a=1.0, e=g)["h"]
    assert_within(grads[0], grads[1], 2 * bound + 2 * EPS32 * grads[1].abs(), what="d hidden")


@pytest.mark.parametrize("chunk_size", [1, 7, 64, None])
def test_independent_of_chunk_size(chunk_size):
    h, w, b, y = _inputs(50, 16, 333, torch.float32, True, 6)
    h.requires_grad_()
    lp, ent = linear_logprobs(h, w, y, bias=b, return_entropy=True, chunk_size=chunk_size)
    (lp.sum() + ent.sum()).backward()
    h2 = h.detach().clone().requires_grad_()
    lp2, ent2 = linear_logprobs(h2, w, y, bias=b, return_entropy=True, chunk_size=50)
    (lp2.sum() + ent2.sum()).backward()
    # different chunkings change only the GEMM blocking and summation order: each result is
    # within tests/_tolerance.py's head bounds of fp64, so the two within twice that
    vb = head_value_bounds(h, w, b, tau=1.0)
    assert_within(lp, lp2, 2 * vb["logp"], what="logp across chunkings")
    assert_within(ent, ent2, 2 * vb["entropy"], what="entropy across chunkings")
    bound = head_grad_bounds(h, w, b, y, tau=1.0, a=1.0, e=1.0)["h"]
    assert_within(h.grad, h2.grad, 2 * bound + 2 * EPS32 * h2.grad.abs(),
                  what="d hidden across chunkings")


def test_3d_and_non_contiguous_inputs():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 24, 9, generator=g)  # (B, H, T): transposed below, so non-contiguous
    h = base.transpose(1, 2)  # (B, T, H) with stride(-1) != 1
    assert not h.is_contiguous()
    w_big = torch.randn(2 * 101, 24, generator=g)
    w = w_big[::2]  # (101, 24) non-contiguous rows
    y = torch.randint(0, 101, (4, 9), generator=g)
    y[0, :3] = -100
    h.requires_grad_()
    lp = linear_logprobs(h, w, y, temperature=0.9, chunk_size=5)
    assert lp.shape == (4, 9)
    h64 = h.detach().double().requires_grad_()
    rl, _ = logprobs_ref(h64, w, y, temperature=0.9)
    h2d, y1d = h.detach().reshape(-1, 24), y.reshape(-1)
    keep = y1d != -100
    vb = head_value_bounds(h2d, w, None, tau=0.9)["logp"] * keep
    assert_within(lp, rl, vb.reshape(4, 9), what="logp 3-D")
    lp.sum().backward()
    rl.sum().backward()
    bound = head_grad_bounds(h2d, w, None, y1d, tau=0.9, a=1.0)["h"].reshape(4, 9, 24)
    assert_head_grad(h.grad, h64.grad, bound, what="d hidden 3-D")


def test_properties_uniform_and_shift_invariance():
    V, H = 1000, 8
    h = torch.randn(6, H)
    y = torch.randint(0, V, (6,))
    lp, ent = linear_logprobs(h, torch.zeros(V, H), y, return_entropy=True)
    logV = torch.log(torch.tensor(float(V)))
    # z = 0: the sum of 1000 ones is exact in fp32, so lse = log V to its own rounding (1 ulp
    # of 6.9 is 5e-7) and H = lse - Σ p z = lse; 1e-6 and (p = 1/V rounded) 1e-5
    torch.testing.assert_close(lp, torch.full((6,), -logV.item()), rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, torch.full((6,), logV.item()), rtol=0, atol=1e-5)
    # a constant added to every logit changes nothing: each within its head bound of the same
    # fp64 value
    w = torch.randn(V, H)
    bias = torch.full((V,), 7.5)
    a = linear_logprobs(h, w, y)
    b = linear_logprobs(h, w, y, bias=bias)
    tol = (head_value_bounds(h, w, None, tau=1.0)["logp"]
           + head_value_bounds(h, w, bias, tau=1.0)["logp"] + 2 * EPS32 * 7.5)
    assert_within(a, b, tol, what="shift invariance")


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_ignored_and_empty(backend, dispatch_override):
    dispatch_override(backend=backend)
    h = torch.randn(3, 5, 8, requires_grad=True)
    w = torch.randn(50, 8)
    y = torch.full((3, 5), -100)
    lp, ent = linear_logprobs(h, w, y, return_entropy=True)
    assert lp.shape == (3, 5) and torch.all(lp == 0) and torch.all(ent == 0)
    (lp.sum() + ent.sum()).backward()
    assert torch.all(h.grad == 0) and not torch.isnan(h.grad).any()
    e = linear_logprobs(torch.randn(0, 8), w, torch.zeros(0, dtype=torch.long))
    assert e.shape == (0,)


def test_ignore_index_none_keeps_every_row():
    h, w, _, y = _inputs(9, 8, 40, torch.float32, False, 0)
    a = linear_logprobs(h, w, y, ignore_index=None)
    r, _ = logprobs_ref(h, w, y, ignore_index=None)
    assert_3way(a, None, r, k=0, atol=VALUE_ATOL, what="logp ignore_index=None")


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(hidden=torch.randn(4, 8), weight=torch.randn(10, 6)), ValueError, "H=8 but weight has H=6"),
        (dict(weight=torch.randn(10, 8, dtype=torch.bfloat16)), TypeError, "hidden is torch.float32 but weight is torch.bfloat16"),
        (dict(targets=torch.randint(0, 10, (5,))), ValueError, r"targets has shape \(5,\)"),
        (dict(targets=torch.tensor([0, 1, 10, 2])), ValueError, r"targets contains 10, outside \[0, 10\)"),
        (dict(targets=torch.tensor([0, 1, -1, 2])), ValueError, r"targets contains -1"),
        (dict(targets=torch.zeros(4)), TypeError, "targets must be an integer tensor"),
        (dict(hidden=torch.randint(0, 3, (4, 8))), TypeError, "hidden must be float32"),
        (dict(temperature=0.0), ValueError, "temperature must be a finite number > 0"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(chunk_size=0), ValueError, "chunk_size must be > 0"),
        (dict(bias=torch.randn(9)), ValueError, r"bias must have shape \(V,\)"),
        (dict(weight=torch.randn(10, 8, 1)), ValueError, "weight must be 2-D"),
    ],
)
def test_bad_input_names_the_argument(kwargs, exc, match):
    args = dict(hidden=torch.randn(4, 8), weight=torch.randn(10, 8), targets=torch.tensor([0, 1, 2, -100]))
    args.update(kwargs)
    h, w, y = args.pop("hidden"), args.pop("weight"), args.pop("targets")
    with pytest.raises(exc, match=match):
        linear_logprobs(h, w, y, **args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_peaked_rows_keep_entropy_digits(backend, dispatch_override):
    """A near one-hot softmax has entropy ~1e-2: it must not be a difference of two ~lse
    numbers (which loses ~1e-3 of it). Tied-embedding models produce exactly such rows."""
    dispatch_override(backend=backend)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 64, generator=g)
    w = torch.randn(1000, 64, generator=g) * 0.2
    w[:64] = h * 0.3
    y = torch.arange(64)
    _, ent = linear_logprobs(h, w, y, return_entropy=True)
    _, ref = logprobs_ref(h, w, y)
    z = (h @ w.t()).log_softmax(-1)
    torch_fp32 = -(z.exp() * z).sum(-1)  # plain torch fp32: the bar to meet
    assert ref.min() < 0.05  # the case is really peaked
    assert_3way(ent, torch_fp32, ref, k=2.0, atol=1e-6, what="peaked entropy")


def test_default_chunk_size_budget_and_small_calls():
    # The budget alone: 256 MiB of fp32 rows at V = 128256 is 523 rows -> 512 (a multiple of 64);
    # with an entropy operand (2 more bytes per entry) 349 -> 320.
    assert default_chunk_size(128256) == 512
    assert default_chunk_size(128256, 1, 2) == 320
    # A call over N rows: at most ceil(N / 8) rounded up to 64, never under 64 rows.
    assert [default_chunk_size(128256, n_rows=n) for n in (1, 500, 1024, 2048, 4096, 10**6)] == [
        64, 64, 128, 256, 512, 512]
    # Tiny vocabularies: the budget allows far more rows than the call has.
    assert default_chunk_size(100, n_rows=10_000) == 1280


# ---------------------------------------------------------------- return_argmax

ARGMAX_GRID = [  # (backend, dtype, fused): fused = the fused GEMM (bf16, interpreter on CPU)
    ("torch", torch.float32, False), ("torch", torch.bfloat16, False),
    ("triton", torch.float32, False), ("triton", torch.bfloat16, False),
    ("triton", torch.bfloat16, True),
]


@pytest.mark.parametrize("backend, dtype, fused", ARGMAX_GRID)
@pytest.mark.parametrize("train_head", [False, True])
def test_argmax_in_the_same_pass(backend, dtype, fused, train_head, dispatch_override):
    """The argmax of the fp32 logits (after bias and τ), −1 at ignored rows; logp, entropy and
    their gradients are those of a call without it. fused=True takes the device-counted row
    layout (valid rows first, their number on the device), whose ignored rows the kernels fill.
    """
    dispatch_override(backend=backend, fused=fused, sync_checks=False)
    h, w, b, y = _inputs(37, 24, 257, dtype, True, 5)
    w.requires_grad_(train_head)
    outs = []
    for want in (True, False):
        hh = h.clone().requires_grad_()
        with recording() as rec:
            out = linear_logprobs(hh, w, y, bias=b, temperature=0.7, return_entropy=True,
                                  return_argmax=want)
        (out[0].sum() + out[1].sum()).backward()
        outs.append((out, hh.grad))
    (lp, ent, amax), dh = outs[0]
    (lp2, ent2), dh2 = outs[1]
    assert rec.paths[0].fused == rec.paths[0].rows_on_device == fused
    assert torch.equal(lp, lp2) and torch.equal(ent, ent2) and torch.equal(dh, dh2)
    # logits of O(3) over 257 tokens: the top two are never within fp32 rounding here
    z = h.double() @ w.detach().double().t() + b.double()
    ref = torch.where(y == -100, -1, z.argmax(-1))
    assert amax.dtype == torch.int64 and amax.shape == y.shape
    assert torch.equal(amax, ref), (amax != ref).nonzero()


@pytest.mark.parametrize("backend", BACKENDS)
def test_argmax_ties_take_the_first_index(backend, dispatch_override):
    """Integer logits, so ties are exact whatever the summation order: the first maximum wins
    (torch.argmax's rule, and TRL's is_top1: a tie with an earlier token is not top-1)."""
    dispatch_override(backend=backend)
    g = torch.Generator().manual_seed(5)
    V, H = 300, 8
    h = torch.randint(-2, 3, (40, H), generator=g).float()
    w = torch.randint(-1, 2, (V, H), generator=g).float()
    w[17] = w[250] = 2.0  # h · w[17] = h · w[250] = 2 Σ h: the top logit for rows with Σ h > 0
    y = torch.randint(0, V, (40,), generator=g)
    y[:3] = -100
    _, amax = linear_logprobs(h, w, y, temperature=0.5, return_argmax=True, chunk_size=16)
    z = h @ w.t()
    assert (z[:, 17] == z.amax(-1)).sum() > 5  # ties really happen
    assert torch.equal(amax, torch.where(y == -100, -1, z.argmax(-1)))
    assert not (amax == 250).any()


def test_argmax_return_shapes():
    h, w, _, y = _inputs(6, 8, 40, torch.float32, False, 2)
    y2 = y.view(2, 3)
    lp, amax = linear_logprobs(h.view(2, 3, 8), w, y2, return_argmax=True)
    assert lp.shape == amax.shape == (2, 3)
    assert torch.equal(amax[y2 == -100], torch.full(((y2 == -100).sum().item(),), -1))
    lp_, ent_, amax_ = linear_logprobs(h, w, y, return_entropy=True, return_argmax=True)
    assert torch.equal(amax_, amax.view(-1)) and torch.equal(lp_, lp.view(-1))
    _, amax0 = linear_logprobs(h, w, torch.full_like(y, -100), return_argmax=True)
    assert torch.equal(amax0, torch.full_like(y, -1))
