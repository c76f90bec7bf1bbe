"""linear_divergence against the fp64 reference: values, entropies and gradients.

Covers β (forward KL, reverse KL, JSD at several β) × both implementations ("basis" on the torch
row ops and on the Triton row kernel under TRITON_INTERPRET=1; "chunked" through chunked_linear)
× dtype (fp32, bf16) × ragged shapes (N = 1 and odd, Hs ≠ Ht, V not a power of two) ×
temperature × biases × masked rows × a frozen or trainable student head, with random upstream
gradients; real vocabularies (Llama 3's 128256, Qwen2's 151936) at small N in `slow`; the
properties (student = teacher gives 0 and a 0 gradient, a fully masked batch, an empty one, a
constant logit shift, chunk-size independence); peaked rows against TRL's own kernel; argument
errors; and a `gpu` test of ours against TRL's kernel and fp64 in bf16 on CUDA. Run:

    python -m pytest tests/test_divergence.py -q            (add -m slow for the real vocabularies)
"""

import pytest
import torch

from grpo_lce import linear_divergence
from grpo_lce.reference import divergence_of_logprobs, divergence_ref, logits_ref
from _tolerance import (K_REORDERED, assert_3way, assert_close_scaled, assert_head_grad,
                        bf16_grad_bounds, divergence_grad_bounds)

# D and H come from fp32 logits whatever the input dtype, so their error against fp64 is fp32
# rounding of an H-term dot product and a V-term sum: ~1e-6 at these sizes, 2e-5 leaves margin
# (the torch user's bf16-logit path is ~1e-2 off, which the 3-way check shows).
VALUE_ATOL = 2e-5
# Gradients: fp32 is GEMM rounding over V terms: tests/_tolerance.py's divergence_grad_bounds in
# test_values_and_grads (1e-4 of the scale elsewhere, where V <= 333 and H <= 48); bf16
# rounds the operand G and the returned dh to bf16: tests/_tolerance.py's bf16_grad_bounds from
# the fp64 G, and never worse than torch's own bf16 path beyond that budget (3-way, k = 1).
GRAD_RTOL = 1e-4

# β: forward KL, reverse KL, the symmetric JSD and two lopsided mixtures (TRL's range is [0, 1])
BETAS = [0.0, 1.0, 0.5, 0.1, 0.9]
# (N, Hs, Ht, V, τ, with_bias, n_masked): N = 1 and odd, Hs ≠ Ht both ways, V odd
CASES = [
    (1, 16, 16, 101, 1.0, False, 0),
    (37, 24, 40, 257, 0.7, True, 5),
    (19, 32, 16, 1000, 1.5, False, 19 // 3),
]
# (method, backend): "chunked" runs torch ops whatever the backend
VARIANTS = [("basis", "torch"), ("basis", "triton"), ("chunked", "torch")]


def _inputs(N, Hs, Ht, V, dtype, with_bias, n_masked, seed=0, teacher_dtype=None):
    """Student and teacher heads whose logits are O(3) (std 3/√H weights): peaked, not one-hot;
    the teacher's weight shares half of the student's direction, so p and q overlap."""
    g = torch.Generator().manual_seed(seed)
    teacher_dtype = teacher_dtype or dtype
    h = torch.randn(N, Hs, generator=g).to(dtype)
    w = (torch.randn(V, Hs, generator=g) * 3 / Hs**0.5).to(dtype)
    x = torch.randn(N, Ht, generator=g)
    x[:, : min(Hs, Ht)] = 0.5 * x[:, : min(Hs, Ht)] + 0.5 * h[:, : min(Hs, Ht)].float()
    u = torch.randn(V, Ht, generator=g) * 3 / Ht**0.5
    u[:, : min(Hs, Ht)] = 0.5 * u[:, : min(Hs, Ht)] + 0.5 * w[:, : min(Hs, Ht)].float()
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if with_bias else None
    c = (torch.randn(V, generator=g) * 0.5).to(teacher_dtype) if with_bias else None
    mask = torch.ones(N, dtype=torch.long)
    mask[torch.randperm(N, generator=g)[:n_masked]] = 0
    return h, w, b, x.to(teacher_dtype), u.to(teacher_dtype), c, mask


def _torch_same_dtype(h, w, b, x, u, c, beta, tau, mask):
    """What a torch user computes today: both logits in the input dtype, then fp32 softmaxes."""
    s = h @ w.t() if b is None else h @ w.t() + b
    t = x @ u.t() if c is None else x @ u.t() + c
    lp, lq = torch.log_softmax(s.float() / tau, -1), torch.log_softmax(t.float() / tau, -1)
    d = divergence_of_logprobs(lp, lq, beta)
    return torch.where(mask != 0, d, 0.0), torch.where(mask != 0, -(lp.exp() * lp).sum(-1), 0.0)


def _check(case, dtype, method, train_head, beta, chunk_size=None):
    N, Hs, Ht, V, tau, with_bias, n_masked = case
    h, w, b, x, u, c, mask = _inputs(N, Hs, Ht, V, dtype, with_bias, n_masked)
    h.requires_grad_(True)
    w.requires_grad_(train_head)
    if b is not None and method == "basis":  # ("chunked" takes no trainable bias)
        b.requires_grad_(train_head)
    d, ent = linear_divergence(h, w, x, u, beta=beta, mask=mask, student_bias=b, teacher_bias=c,
                               temperature=tau, return_entropy=True, method=method,
                               chunk_size=chunk_size)
    assert d.dtype == ent.dtype == torch.float32 and d.shape == ent.shape == (N,)
    assert not ent.requires_grad

    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    rd, rent = divergence_ref(h64, w64, x, u, beta=beta, mask=mask, student_bias=b64,
                              teacher_bias=c, temperature=tau)
    with torch.no_grad():
        td, tent = _torch_same_dtype(h, w, b, x, u, c, beta, tau, mask)
    # fp32: also within K_REORDERED of torch's own fp32 error (the same sums in another order)
    k = K_REORDERED if dtype == torch.float32 else 0.0
    assert_3way(d, td, rd, k=k, atol=VALUE_ATOL, what=f"D β={beta}")
    assert_3way(ent, tent, rent, k=k, atol=VALUE_ATOL, what="entropy")
    assert torch.all(d[mask == 0] == 0) and torch.all(ent[mask == 0] == 0)

    # a per-token loss weighs every token differently: random upstream gradients
    up = torch.randn(N, generator=torch.Generator().manual_seed(1))
    (d * up).sum().backward()
    (rd * up.double()).sum().backward()
    assert h.grad.dtype == dtype
    assert torch.all(h.grad[mask == 0] == 0)
    pairs = [("student_hidden", h, h64)]
    if train_head:
        assert w.grad.dtype == dtype
        pairs.append(("student_weight", w, w64))
        if b is not None and b.requires_grad:
            pairs.append(("student_bias", b, b64))
    # G = dD/dz_s in fp64 (autograd on the fp64 logits): the magnitudes the bounds scale with
    z64 = logits_ref(h.detach(), w.detach(), None if b is None else b.detach(),
                     tau).requires_grad_()
    lq = torch.log_softmax(logits_ref(x, u, c, tau), -1)
    d64 = divergence_of_logprobs(torch.log_softmax(z64, -1), lq, beta)
    (torch.where(mask != 0, d64, 0.0) * up.double()).sum().backward()
    if dtype == torch.float32:  # fp32 rounding from the sum lengths and the terms' sizes
        bounds = divergence_grad_bounds(h, w, b, x, u, c, tau=tau, up=up * (mask != 0),
                                        G=z64.grad)
        for name, t, t64 in pairs:
            assert_head_grad(t.grad, t64.grad, bounds[name.removeprefix("student_")[0]],
                             what=f"d {name}")
    else:  # bf16 operands cost 2^-8 of the same magnitudes
        bounds = bf16_grad_bounds(h, w, z64.grad, tau=tau)
        for name, t, t64 in pairs:
            assert_head_grad(t.grad, t64.grad, bounds[name.removeprefix("student_")[0]],
                             what=f"d {name}")
        ht = h.detach().clone().requires_grad_()
        td, _ = _torch_same_dtype(ht, w.detach(), None if b is None else b.detach(), x, u, c,
                                  beta, tau, mask)
        (td * up).sum().backward()
        # and never worse than torch's own bf16-logit path beyond that budget
        assert_3way(h.grad, ht.grad, h64.grad, k=1.0, atol=bounds["h"].max().item(),
                    what="d student_hidden vs torch bf16")


def _grid():
    """case × β × variant × dtype × train_head. The Triton interpreter runs every kernel
    program in Python, so under it only the smaller cases, β ∈ {0, 1, 0.5}, a frozen head (its
    trainable-head recompute runs the same kernel, covered by torch) and bf16 at N = 1 stay in
    the default run; the lopsided β (0.1, 0.9) run in fp32 there, in bf16 under `slow`."""
    for case in CASES:
        for beta in BETAS:
            for method, backend in VARIANTS:
                for dtype, dname in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                    for train_head in (False, True):
                        slow = (backend == "triton" and (
                            train_head or case[3] > 300 or beta in (0.1, 0.9)
                            or (case[0] > 1 and dtype == torch.bfloat16))
                        ) or (beta in (0.1, 0.9) and dtype == torch.bfloat16)
                        yield pytest.param(
                            case, dtype, method, backend, train_head, beta,
                            marks=[pytest.mark.slow] if slow else [],
                            id=f"{method}-{backend}-{'trainW' if train_head else 'frozenW'}-"
                               f"N{case[0]}-V{case[3]}-{dname}-beta{beta}")


@pytest.mark.parametrize("case, dtype, method, backend, train_head, beta", list(_grid()))
def test_values_and_grads(case, dtype, method, backend, train_head, beta, dispatch_override):
    dispatch_override(backend=backend)
    _check(case, dtype, method, train_head, beta, chunk_size=8)


# Real vocabularies at small N (fp64 (N, V) references fit): Llama 3 and Qwen2.
@pytest.mark.slow
@pytest.mark.parametrize("V", [128256, 151936])
@pytest.mark.parametrize("method, backend", VARIANTS)
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_real_vocabularies(V, method, backend, beta, dispatch_override):
    dispatch_override(backend=backend)
    _check((5, 32, 48, V, 1.0, True, 1), torch.bfloat16, method, train_head=False, beta=beta)
    if backend == "torch":
        _check((5, 32, 48, V, 0.8, False, 1), torch.float32, method, train_head=True, beta=beta)


# ---------------------------------------------------------------- properties


@pytest.mark.parametrize("method, backend", VARIANTS)
@pytest.mark.parametrize("beta", BETAS)
def test_student_equal_to_teacher_gives_zero(method, backend, beta, dispatch_override):
    dispatch_override(backend=backend)
    h, w, *_ = _inputs(13, 24, 24, 300, torch.float32, False, 0)
    h.requires_grad_()
    d = linear_divergence(h, w, h.detach().clone(), w.clone(), beta=beta, method=method)
    # identical fp32 logits: log p = log q to the bit, log m = log p to one rounding
    assert d.abs().max().item() <= 1e-6
    d.sum().backward()
    assert h.grad.abs().max().item() <= 1e-6 * w.abs().max().item()


@pytest.mark.parametrize("method, backend", VARIANTS)
@pytest.mark.parametrize("train_head", [False, True])
def test_fully_masked_and_empty(method, backend, train_head, dispatch_override):
    dispatch_override(backend=backend)
    h = torch.randn(3, 5, 8, requires_grad=True)
    w = torch.randn(50, 8, requires_grad=train_head)
    x, u = torch.randn(3, 5, 12), torch.randn(50, 12)
    d, ent = linear_divergence(h, w, x, u, beta=0.5, mask=torch.zeros(3, 5, dtype=torch.bool),
                               return_entropy=True, method=method)
    assert d.shape == ent.shape == (3, 5) and torch.all(d == 0) and torch.all(ent == 0)
    d.sum().backward()
    assert torch.all(h.grad == 0)
    if train_head:
        assert w.grad is None or torch.all(w.grad == 0)
    e = linear_divergence(torch.randn(0, 8), w.detach(), torch.randn(0, 12), u, beta=0.0,
                          method=method)
    assert e.shape == (0,)


@pytest.mark.parametrize("method", ["basis", "chunked"])
def test_constant_shift_changes_nothing(method):
    h, w, _, x, u, _, _ = _inputs(11, 16, 20, 400, torch.float32, False, 0)
    V = w.shape[0]
    a = linear_divergence(h, w, x, u, beta=0.3, method=method)
    b = linear_divergence(h, w, x, u, beta=0.3, method=method,
                          student_bias=torch.full((V,), 7.5), teacher_bias=torch.full((V,), -3.0))
    torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_independent_of_chunk_size_and_3d(chunk_size):
    h, w, b, x, u, c, mask = _inputs(24, 16, 20, 333, torch.float32, True, 5)
    h, x, mask = h.reshape(4, 6, 16), x.reshape(4, 6, 20), mask.reshape(4, 6)
    grads = []
    for cs in (chunk_size, 24):
        hh = h.clone().requires_grad_()
        d = linear_divergence(hh, w, x, u, beta=0.5, mask=mask, student_bias=b, teacher_bias=c,
                              chunk_size=cs)
        assert d.shape == (4, 6)
        d.sum().backward()
        grads.append((d.detach(), hh.grad))
    # different chunkings change only GEMM blocking and summation order: both within their
    # bounds of fp64 (VALUE_ATOL per value; GRAD_RTOL of the scale per gradient), so 2x apart
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=2 * VALUE_ATOL)
    assert_close_scaled(grads[0][1], grads[1][1], rtol=2 * GRAD_RTOL,
                        what="dh across chunkings")


def test_teacher_in_another_dtype_and_width():
    # a bf16 teacher of another width teaching an fp32 student: each GEMM in its own dtype
    h, w, b, x, u, c, mask = _inputs(9, 16, 48, 200, torch.float32, True, 2,
                                     teacher_dtype=torch.bfloat16)
    d = linear_divergence(h, w, x, u, beta=0.0, mask=mask, student_bias=b, teacher_bias=c)
    rd, _ = divergence_ref(h, w, x, u, beta=0.0, mask=mask, student_bias=b, teacher_bias=c)
    assert_3way(d, None, rd, k=0.0, atol=VALUE_ATOL, what="D, bf16 teacher")


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_peaked_rows_keep_their_digits(beta, backend, dispatch_override):
    """Confident models (logits of O(25-100), entropies of 1e-4 .. 1e-1): the top token's log p
    is −log1p(r), so D and the entropy carry no error beyond that of the fp32 logits themselves
    (the floor: the exact divergence of our fp32 logits), where TRL's kernel, which forms them
    as differences of running sums near the max logit, adds its own."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    dispatch_override(backend=backend)
    h, w, _, x, u, _, _ = _inputs(16, 32, 32, 500, torch.float32, False, 0)
    w, u = w * 8, u * 8
    d, ent = linear_divergence(h, w, x, u, beta=beta, return_entropy=True)
    rd, rent = divergence_ref(h, w, x, u, beta=beta)
    with torch.no_grad():
        trl_d, trl_ent = ChunkedDivergenceFunction.apply(h, w, None, x, u, None, beta, 1.0)
    # the floor: fp64 math on the fp32 logits (h, w and x, u as fp32 products, exactly held)
    fd, fent = divergence_ref((h @ w.t()).double(), torch.eye(500, dtype=torch.float64),
                              (x @ u.t()).double(), torch.eye(500, dtype=torch.float64),
                              beta=beta)
    for ours, trl_val, ref, floor, what in ((d, trl_d, rd, fd, "D"),
                                            (ent, trl_ent, rent, fent, "entropy")):
        e_floor = (floor - ref).abs().max().item()
        # relative to each value: 1e-4, 7× the floor's 1.4e-5 at these logits
        assert ((ours.double() - ref).abs() / ref.abs()).max().item() < 1e-4, what
        assert_3way(ours, trl_val, ref, k=1.0, atol=2 * e_floor,
                    what=f"{what} β={beta} vs TRL's kernel")


@pytest.mark.parametrize("kwargs, match", [
    ({"beta": 1.5}, "beta must be a float in"),
    ({"beta": 0.5, "method": "fused"}, "method must be one of"),
    ({"beta": 0.5, "mask": torch.ones(3, dtype=torch.bool)}, "mask has shape"),
    ({"beta": 0.5, "temperature": 0.0}, "temperature"),
])
def test_bad_arguments(kwargs, match):
    h, w, x, u = torch.randn(4, 8), torch.randn(30, 8), torch.randn(4, 6), torch.randn(30, 6)
    with pytest.raises(ValueError, match=match):
        linear_divergence(h, w, x, u, **kwargs)


def test_mismatched_teacher_is_named():
    h, w = torch.randn(4, 8), torch.randn(30, 8)
    with pytest.raises(ValueError, match="teacher_weight has V=31"):
        linear_divergence(h, w, torch.randn(4, 6), torch.randn(31, 6), beta=0.5)
    with pytest.raises(ValueError, match="teacher: hidden has H=5"):
        linear_divergence(h, w, torch.randn(4, 5), torch.randn(30, 6), beta=0.5)
    with pytest.raises(ValueError, match="teacher_hidden has leading shape"):
        linear_divergence(h, w, torch.randn(5, 6), torch.randn(30, 6), beta=0.5)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("method", ["basis", "chunked"])
def test_gpu_bf16_against_trl_kernel_and_fp64(beta, method):
    """bf16 on CUDA at a real vocabulary: ours, TRL's ChunkedDivergenceFunction and fp64.
    Values: fp32 logits on both sides, ours at least as close to fp64 as TRL's kernel (k = 1,
    atol 1e-5: the two round differently at the 1e-6 level). Gradients: both round the operand
    to bf16 (2^-8) and dh to bf16; ours within 1.25 × TRL's error + 2^-9 of the scale."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    N, Hs, Ht, V = 512, 2048, 3072, 128256
    h, w, _, x, u, _, _ = _inputs(N, Hs, Ht, V, torch.float32, False, 0)
    dev = torch.device("cuda")
    h, w, x, u = (t.to(dev, torch.bfloat16) for t in (h, w, x, u))
    up = torch.randn(N, device=dev)

    hh = h.clone().requires_grad_()
    d = linear_divergence(hh, w, x, u, beta=beta, method=method)
    (d * up).sum().backward()
    ht = h.clone().requires_grad_()
    trl_d, _ = ChunkedDivergenceFunction.apply(ht, w, None, x, u, None, beta, 1.0)
    (trl_d * up).sum().backward()
    h64 = h.double().requires_grad_()
    rd, _ = divergence_ref(h64, w, x, u, beta=beta)
    (rd * up.double()).sum().backward()

    assert_3way(d, trl_d, rd, k=1.0, atol=1e-5, what=f"D β={beta} (GPU, bf16)")
    scale = h64.grad.abs().max().item()
    assert_3way(hh.grad, ht.grad, h64.grad, k=1.25, atol=2**-9 * scale,
                what=f"dh β={beta} (GPU, bf16)")
