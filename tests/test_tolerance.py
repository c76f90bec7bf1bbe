"""tests/_tolerance.py's fp64 truth through TRL's fused head: `in_fp64` hands TRL's
`ChunkedLogProbFunction` (trl.kernels.chunked_logprob: fp32 tiles, p and gradients whatever the
inputs' dtype) to `fused_head_torch` in fp64 for fp64 inputs.

Covers: `fused_head_torch` computes what TRL's head computes (log-probs, entropy, log Σ p², mean
logit, is_top1; logit scale, softcap, τ, bias; subsets of the outputs left None; the three
without a gradient) and the same gradients; `in_fp64` routes a fused forward of an fp64 model
to it, leaves fp32 calls to TRL's head, and puts TRL's head back after, an error included.

    PYTHONPATH=tests python -m pytest tests/test_tolerance.py -q

Tolerances: three-way, TRL's fp32 head against `fused_head_torch` in fp64 within K_REORDERED of
`fused_head_torch`'s own fp32 error: two fp32 computations of the same values in different
orders (a wrong transform order or definition is O(1) away). Floors: the rounding of a V-term
sum of terms up to max|z| for the values, 4 ulp of the norm for the gradients
(`assert_grads_vs_fp64`).
"""

from __future__ import annotations

import pytest
import torch
import trl.trainer.utils as trl_utils
from _tolerance import (EPS32, K_REORDERED, assert_3way, assert_grads_vs_fp64,
                        fused_head_torch, in_fp64, sum_bound)
from trl.kernels.chunked_logprob import OPTIONAL_OUTPUTS, ChunkedLogProbFunction
from trl.trainer.utils import add_fused_lm_head

from trainers.tiny import build_tiny_llama, build_tokenizer

# ragged sizes, V over several of TRL's 64-wide vocabulary tiles
N, H, V, CHUNK = 37, 16, 203, 64
NAMES = ("logprobs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _inputs(bias: bool, seed: int = 0):
    """h (N, H), W (V, H), b (V,) or None, y (N,): logits of a few units; every other target
    the row's argmax, so is_top1 is exercised both ways."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.5
    b = torch.randn(V, generator=g) * 0.5 if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    z = h.double() @ w.double().T + (0.0 if b is None else b.double())
    y[::2] = z.argmax(-1)[::2]
    return h, w, b, y


def _run(fn, h, w, b, y, dtype, options, a, e):
    """fn's 5 outputs and the gradients of Σ a log p_y + e H for inputs in `dtype`."""
    h, w, b = (None if t is None else t.to(dtype, copy=True).requires_grad_() for t in (h, w, b))
    out = fn(h, w, b, y, *options)
    loss = (a.to(dtype) * out[0]).sum()
    if out[1] is not None:
        loss = loss + (e.to(dtype) * out[1]).sum()
    loss.backward()
    grads = {"hidden": h.grad, "weight": w.grad} | ({} if b is None else {"bias": b.grad})
    return out, grads


@pytest.mark.parametrize("softcap,scale,tau,bias,outputs", [
    (None, 1.0, 1.0, False, OPTIONAL_OUTPUTS),
    (None, 0.5, 0.7, True, OPTIONAL_OUTPUTS),
    (3.0, 2.0, 0.7, True, OPTIONAL_OUTPUTS),  # tanh(s z / 3) far from linear at |s z| ~ 6
    (3.0, 1.0, 1.3, False, ("entropy",)),
    (None, 1.0, 1.0, True, ()),  # log-probs only, as TRL's default `outputs`
])
def test_fused_head_torch_is_trls_head(softcap, scale, tau, bias, outputs):
    h, w, b, y = _inputs(bias)
    g = torch.Generator().manual_seed(1)
    a, e = torch.randn(N, generator=g), torch.randn(N, generator=g)
    options = (tau, softcap, scale, outputs)

    def trl_head(h, w, b, y, tau, softcap, scale, outputs):
        return ChunkedLogProbFunction.apply(h, w, b, y, tau, CHUNK, softcap, scale, outputs)

    trl_out, trl_g = _run(trl_head, h, w, b, y, torch.float32, options, a, e)
    t32_out, t32_g = _run(fused_head_torch, h, w, b, y, torch.float32, options, a, e)
    ref_out, ref_g = _run(fused_head_torch, h, w, b, y, torch.float64, options, a, e)

    with torch.no_grad():  # the fp64 logits, to size the floors
        z = (h.double() @ w.double().T + (0.0 if b is None else b.double())) * scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        z = z / tau
    z_max = z.abs().max().item()
    for name, o, t, r in zip(NAMES, trl_out, t32_out, ref_out):
        wanted = name == "logprobs" or name in outputs
        assert (o is not None) == (r is not None) == (t is not None) == wanted, name
        if o is None:
            continue
        differentiable = name in ("logprobs", "entropy")
        assert o.requires_grad == r.requires_grad == differentiable, name
        if name == "is_top1":
            # a flip needs the fp32 logits to move by half the top-2 gap: compare the rows
            # whose gap exceeds twice the logits' rounding (H-term dots, the transform's ulps)
            top2 = z.topk(2, -1).values
            dz = sum_bound(H, (h.abs() @ w.abs().T).max().item()) * abs(scale) / tau + (
                4 * EPS32 * z_max)
            clear = (top2[:, 0] - top2[:, 1]) > 2 * dz
            assert torch.equal(o[clear], r[clear]) and r[clear].any() and not r[clear].all()
            continue
        assert o.dtype == t.dtype == torch.float32 and r.dtype == torch.float64
        assert_3way(o, t, r, k=K_REORDERED, atol=sum_bound(V, z_max), what=f"TRL head {name}")
    assert_grads_vs_fp64(trl_g, t32_g, ref_g, what="TRL head grad")


def test_in_fp64_gives_trls_head_fp64_and_back():
    tok = build_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, tie_word_embeddings=False)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids = torch.randint(8, len(tok), (2, 7), generator=torch.Generator().manual_seed(0))
    h, w, b, y = _inputs(bias=False)
    trl32 = ChunkedLogProbFunction.apply(h, w, None, y, 0.7, CHUNK, None, 1.0, OPTIONAL_OUTPUTS)

    with torch.no_grad(), in_fp64(model):
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        logits = model(input_ids=ids).logits[:, :-1]  # (2, 6, V) fp64: the model's own head
        # an fp32 call inside the block is TRL's, unchanged
        inside = trl_utils._ChunkedLogProbFunction.apply(h, w, None, y, 0.7, CHUNK, None, 1.0,
                                                         OPTIONAL_OUTPUTS)
    assert out.log_probs.dtype == out.entropy.dtype == torch.float64
    # the same fp64 logits summed in two orders (F.linear, h @ Wᵀ): 1e-12 is ~1e3 ulp of them
    logp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.log_probs, logp.gather(-1, ids[:, 1:, None]).squeeze(-1),
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(out.entropy, -(logp.exp() * logp).sum(-1), rtol=0, atol=1e-12)
    for a, b in zip(inside, trl32):
        assert (a is None and b is None) or torch.equal(a, b)
    assert trl_utils._ChunkedLogProbFunction is ChunkedLogProbFunction
    assert model.lm_head.weight.dtype == torch.float32

    with pytest.raises(RuntimeError, match="inside"), in_fp64(model):
        raise RuntimeError("inside")
    assert trl_utils._ChunkedLogProbFunction is ChunkedLogProbFunction
