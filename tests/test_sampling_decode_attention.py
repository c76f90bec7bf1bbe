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


def _rope_inputs(device, *, split, bias, B=4, HKV=2, G=3, D=16, M=300, seed=3):
    """The decode step's q/k/v (plain bf16, or SplitSums of 2 fp32 partials with biases), cos /
    sin tables (M, D) bf16, a cache of valid keys below each row's slot and NaN garbage from it
    on (so a read of the slot before its write shows), and the slots: split edges."""
    from trainers.sampling.kernels.split_sum import SplitSum

    g = torch.Generator().manual_seed(seed)
    slots = torch.tensor([0, 63, 64, M - 1][:B])

    def proj(h):
        if not split:
            return torch.randn(B, h, D, generator=g).to(device, torch.bfloat16)
        b = torch.randn(h * D, generator=g).to(device, torch.bfloat16) if bias else None
        return SplitSum(torch.randn(2, B, h * D, generator=g).to(device), b, torch.bfloat16,
                        h * D).view(B, h, D)

    q, k, v = proj(HKV * G), proj(HKV), proj(HKV)
    pos = torch.arange(M)[:, None] / (10000 ** (torch.arange(D // 2) / (D // 2)))[None, :]
    ang = torch.cat([pos, pos], dim=1)
    cos, sin = (f(ang).to(device, torch.bfloat16) for f in (torch.cos, torch.sin))
    cache_k = torch.randn(B, HKV, M, D, generator=g)
    cache_v = torch.randn(B, HKV, M, D, generator=g)
    for b, n in enumerate(slots.tolist()):
        cache_k[b, :, n:] = float("nan")
        cache_v[b, :, n:] = float("nan")
    return (q, k, v, cos, sin, cache_k.to(device, torch.bfloat16),
            cache_v.to(device, torch.bfloat16), slots.to(device))


@pytest.mark.parametrize("split,bias", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("window", [None, 50])
def test_rope_attention_is_rope_then_attention(split, bias, window, device="cpu"):
    """`rope_attention` (one launch) against `rope_cache_write` then `decode_attention`: the
    same cache bits (the new slot written, nothing else touched) and the same output bits,
    across split edges (SPLIT_N 64 here), odd G, SplitSum inputs with biases, a window; the
    fused launch counted as the one that summed the SplitSums."""
    from trainers.sampling import decode_attention as module
    from trainers.sampling.kernels.rope import rope_cache_write
    from trainers.sampling.kernels.split_sum import CONSUMED

    q, k, v, cos, sin, ck, cv, slots = _rope_inputs(device, split=split, bias=bias)
    B, HKV, D = k.shape
    G = q.shape[1] // HKV
    cfg = {"SPLIT_N": 64, "BLOCK_N": 16}
    ck2, cv2 = ck.clone(), cv.clone()
    q_rot = rope_cache_write(q, k, v, cos, sin, ck2, cv2, slots, tables=True)
    ref = decode_attention(q_rot.view(B, HKV, G, D), ck2, cv2, slots, scale=0.3, window=window,
                           config=cfg)
    consumed = CONSUMED["rope_attention"]
    o = module.rope_attention(q, k, v, cos, sin, ck, cv, slots, scale=0.3, window=window,
                              config=cfg)
    assert CONSUMED["rope_attention"] == consumed + (3 if split else 0)
    assert o.shape == ref.shape and o.dtype == ref.dtype
    torch.testing.assert_close(ck, ck2, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(cv, cv2, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(o, ref), (o.float() - ref.float()).abs().max()


def test_rope_attention_falls_back_to_two_calls(monkeypatch):
    """Where the fused launch does not apply (fp32 rotation, q/k norms) the two calls run: the
    kernel is not launched and the result is theirs."""
    from trainers.sampling import decode_attention as module
    from trainers.sampling.kernels.rope import rope_cache_write

    q, k, v, cos, sin, ck, cv, slots = _rope_inputs("cpu", split=False, bias=False, B=2)
    q, k, v, ck, cv = (t.float() for t in (q, k, v, ck, cv))
    B, HKV, D = k.shape
    launched = []
    monkeypatch.setattr(module, "_rope_attention_kernel", launched)  # a launch would fail
    ck2, cv2 = ck.clone(), cv.clone()
    o = module.rope_attention(q, k, v, cos.float(), sin.float(), ck, cv, slots, scale=0.3)
    q_rot = rope_cache_write(q, k, v, cos.float(), sin.float(), ck2, cv2, slots, tables=True)
    ref = decode_attention(q_rot.view(B, HKV, -1, D), ck2, cv2, slots, scale=0.3)
    assert torch.equal(o, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split,bias", [(False, False), (True, True)])
@pytest.mark.parametrize("window", [None, 50])
def test_rope_attention_is_rope_then_attention_gpu(split, bias, window):
    test_rope_attention_is_rope_then_attention(split, bias, window, device="cuda")
