"""trainers.sampling.decode_attention: split-K decode attention over each row's valid keys.

CPU: the Triton interpreter (conftest sets TRITON_INTERPRET without CUDA) against an fp64
softmax attention, ragged lengths across split boundaries, GQA, with and without a sliding
window, and garbage (NaN) past every row's last key, which must never be read. GPU (`gpu`): the
same in bf16 against fp64, next to SDPA's own bf16 error.

    python -m pytest tests/test_sampling_decode_attention.py -q
"""

from __future__ import annotations

import pytest
import torch

from trainers.sampling.decode_attention import SPLIT_N, decode_attention


def reference(q, K, V, last, scale, window):
    """fp64 softmax attention of q (B, H_kv, G, D) over keys lo_b..last_b."""
    j = torch.arange(K.shape[2])
    ok = j[None] <= last[:, None]
    if window is not None:
        ok &= j[None] > last[:, None] - window
    Kd, Vd = K.double().nan_to_num(), V.double().nan_to_num()
    z = torch.einsum("bhgd,bhmd->bhgm", q.double(), Kd) * scale
    z = z.masked_fill(~ok[:, None, None], float("-inf"))
    return torch.einsum("bhgm,bhmd->bhgd", z.softmax(-1), Vd)


def inputs(dtype, device, M=2 * SPLIT_N + 44, D=16, G=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, HKV = 4, 2
    q = torch.randn(B, HKV, G, D, generator=g)
    K = torch.randn(B, HKV, M, D, generator=g)
    V = torch.randn(B, HKV, M, D, generator=g)
    last = torch.tensor([0, SPLIT_N - 1, SPLIT_N, M - 1])  # split edges and the whole cache
    for b, n in enumerate(last.tolist()):  # keys past last_b are garbage: NaN
        K[b, :, n + 1:] = float("nan")
        V[b, :, n + 1:] = float("nan")
    return [t.to(device, dtype) for t in (q, K, V)] + [last.to(device)]


@pytest.mark.parametrize("config", [None, {"SPLIT_N": 64, "BLOCK_N": 16}])
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("G", [4, 1])
def test_matches_fp64_softmax_attention(window, G, config):
    """fp32 (IEEE dots): each output is a convex combination of V rows computed with at most
    M-term fp32 sums (the softmax weights', and the weighted V rows'), each off by at most
    M · 2^-24 relative: |error| <= 4 · M · 2^-24 · max|V|. The default tiles and smaller ones
    (more splits than rows have keys for: empty splits in the combine)."""
    q, K, V, last = inputs(torch.float32, "cpu", G=G)
    out = decode_attention(q, K, V, last, scale=0.25, window=window, config=config)
    ref = reference(q, K, V, last, 0.25, window)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    bound = 4 * K.shape[2] * 2**-24 * V.nan_to_num().abs().max().item()
    assert err <= bound, (err, bound)


@pytest.mark.parametrize("window", [None, 50])
def test_bf16_matches_fp64_within_its_roundings(window):
    """bf16 q, K, V (the decode step's dtype; on CPU the interpreter's dots are upcast by
    `_interp.dot`, exact bf16 products as on the GPU): o = Σ_j p_j V_j / Σ_j p_j with each p_j
    rounded to bf16 for the P·V dot (relative u = 2⁻⁸ each, so at most u · max|V| on o, since
    the p_j / Σ p weights sum to 1) and o rounded once (u · |o| <= u · max|V|); the fp32 sums
    add ~M · 2⁻²⁴ relative. Reference: fp64 attention on the same bf16 values."""
    q, K, V, last = inputs(torch.bfloat16, "cpu", D=32)
    out = decode_attention(q, K, V, last, scale=0.125, window=window)
    ref = reference(q, K, V, last, 0.125, window)
    vmax = V.double().nan_to_num().abs().max().item()
    err = (out.double() - ref).abs().max().item()
    assert err <= (2 * 2**-8 + K.shape[2] * 2**-24) * vmax, (err, vmax)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 50])
def test_gpu_bf16_within_sdpa_error(window):
    """bf16: error vs fp64 within 2x SDPA's own bf16 error (+ one bf16 ulp at |o| ~ 1)."""
    q, K, V, last = inputs(torch.bfloat16, "cuda", D=64)
    out = decode_attention(q, K, V, last, scale=0.125, window=window)
    ref = reference(q.cpu(), K.cpu(), V.cpu(), last.cpu(), 0.125, window)
    j = torch.arange(K.shape[2], device="cuda")
    ok = j[None] <= last[:, None]
    if window is not None:
        ok &= j[None] > last[:, None] - window
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, K.nan_to_num(), V.nan_to_num(), attn_mask=ok[:, None, None], scale=0.125)
    err = (out.double().cpu() - ref).abs().max().item()
    sdpa_err = (sdpa.double().cpu() - ref).abs().max().item()
    assert err <= 2 * sdpa_err + 2**-8, (err, sdpa_err)


def test_combine_in_launch_is_the_torch_combine(monkeypatch):
    """The last split's combine (one launch) against the torch ops a call without counters runs
    (a first call under capture): the same formula, the S-term sums in another order, so within
    a few fp32 roundings of |o| ≤ max|V|; and the counters are back at zero after the call."""
    from trainers.sampling import decode_attention as module
    from trainers.sampling.kernels import arrivals

    q, K, V, last = inputs(torch.float32, "cpu", G=3)
    fused = decode_attention(q, K, V, last, scale=0.25, window=None)
    assert not arrivals.COUNTERS[q.device].any(), "arrival counters left nonzero"
    monkeypatch.setattr(module, "arrival_counters", lambda device, n: None)
    split = decode_attention(q, K, V, last, scale=0.25, window=None)
    bound = 8 * 2**-24 * V.nan_to_num().abs().max().item()
    assert (fused - split).abs().max().item() <= bound
    assert torch.isfinite(fused).all()
