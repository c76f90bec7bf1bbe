"""trainers.sampling.kernels.rope: RoPE + KV-cache write of one decode token against transformers'
own `apply_rotary_pos_emb` (Llama, Qwen2, Mistral, Qwen3 with its q_norm / k_norm before it) and
the decode loop's index_put of k and v into the cache.

    python -m pytest -q tests/test_decode_rope.py            # CPU (Triton's interpreter)
    python -m pytest -q -m gpu tests/test_decode_rope.py     # H100

cos / sin come from each family's own rotary embedding module at real configs (Llama-3.1 and
Llama-3.2's llama3 scaling, linear, dynamic NTK above the trained length, YaRN's scaled cos / sin),
so the kernel, which only reads cos / sin, is checked on each of them. Tolerance (module
docstring): without q/k norms the rotated q, the whole cache K and V (the written slots and every
other slot) are bit for bit transformers'; with Qwen3's norms the rotated values are within
(ε_y + 4u)(1 + ε_y)(1 + u) · T_i, T_i = |y_i cos_i| + |y_j sin_i|, and the normed values alone
(cos = 1, sin = 0) within Qwen3RMSNorm's own bound ε_y.
"""

import copy
import types

import pytest
import torch

from trainers.sampling.kernels.rope import (
    norm_params,
    rope_cache_write,
    rope_cache_write_torch,
)

transformers = pytest.importorskip("transformers")

from transformers.models.llama import modeling_llama as llama
from transformers.models.mistral import modeling_mistral as mistral
from transformers.models.qwen2 import modeling_qwen2 as qwen2
from transformers.models.qwen3 import modeling_qwen3 as qwen3

# rope_parameters of released models (config.json's rope_theta and rope_scaling)
LLAMA31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA32 = {**LLAMA31, "factor": 32.0}
ROPES = {
    "llama-default": (llama, {"rope_type": "default", "rope_theta": 10000.0}),
    "llama-3.1": (llama, LLAMA31),
    "llama-3.2": (llama, LLAMA32),
    "llama-linear": (llama, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "llama-dynamic": (llama, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    "llama-yarn": (llama, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 4096}),
    "qwen2": (qwen2, {"rope_type": "default", "rope_theta": 1000000.0}),
    "mistral": (mistral, {"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3": (qwen3, {"rope_type": "default", "rope_theta": 1000000.0}),
}
MAX_POS = 8192 * 16  # 131072, Llama-3.1's max_position_embeddings
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def _parts(name, *, hkv, g, d, dtype, batch, seed=0, cache_len=24, norm_dtype=None):
    """Inputs of one decode step of one layer: the projections' flat outputs (B, 1, H·D), cos /
    sin of the family's rotary module at positions spanning the short, the trained and (dynamic)
    beyond-trained range, a cache (B, Hkv, M, D) of random values and slots 0, mid and last."""
    module, rope = ROPES[name]
    prefix = {llama: "Llama", qwen2: "Qwen2", mistral: "Mistral", qwen3: "Qwen3"}[module]
    config_cls = getattr(transformers, prefix + "Config")
    hq = g * hkv
    config = config_cls(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv,
                        head_dim=d, max_position_embeddings=MAX_POS if "dynamic" not in name
                        else 4096, rope_parameters=dict(rope))
    rotary = getattr(module, prefix + "RotaryEmbedding")(config)
    gen = torch.Generator().manual_seed(seed)
    pos = torch.tensor([0, 7, 4095, 8191, 9000, 70000, MAX_POS - 1])[
        torch.randperm(7, generator=gen)][:batch]
    pos = torch.cat([pos, torch.randint(0, MAX_POS, (max(0, batch - 7),), generator=gen)])
    x = torch.zeros(1, dtype=dtype)
    cos, sin = rotary(x, pos[:, None])  # (B, 1, D) in dtype
    flat = {n: (torch.randn(batch, 1, h * d, generator=gen) * 2).to(dtype)
            for n, h in (("q", hq), ("k", hkv), ("v", hkv))}
    cache = [torch.randn(batch, hkv, cache_len, d, generator=gen).to(dtype) for _ in range(2)]
    slots = torch.tensor([0, cache_len // 2, cache_len - 1])[torch.arange(batch) % 3]
    norms = None
    if module is qwen3:
        norms = []
        for _ in range(2):
            norm = qwen3.Qwen3RMSNorm(d, eps=1e-6)
            with torch.no_grad():
                norm.weight.copy_(1 + 0.3 * torch.randn(d, generator=gen))
            norms.append(norm.to(norm_dtype or dtype))
    return module, flat, cos, sin, cache, slots, norms


def _reference(module, flat, cos, sin, cache, slots, norms, d):
    """transformers' attention up to its cache update: view, (q/k norm,) transpose, RoPE; then the
    decode loop's write of k and v to slot slots_b of row b."""
    B = cos.shape[0]
    q, k, v = (flat[n].view(B, 1, -1, d) for n in "qkv")
    if norms is not None:
        with torch.no_grad():
            q, k = norms[0](q), norms[1](k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, 1, D)
    q_rot, k_rot = module.apply_rotary_pos_emb(q, k, cos, sin)
    ck, cv = cache[0].clone(), cache[1].clone()
    rows = torch.arange(B)
    ck[rows, :, slots] = k_rot[:, :, 0].to(ck.dtype)
    cv[rows, :, slots] = v[:, :, 0].to(cv.dtype)
    return q_rot[:, :, 0], ck, cv, (q, k)


def _ours(flat, cos, sin, cache, slots, norms, d):
    B = cos.shape[0]
    ck, cv = cache[0].clone(), cache[1].clone()
    params = (None, None) if norms is None else \
        norm_params(types.SimpleNamespace(q_norm=norms[0], k_norm=norms[1]))
    with torch.no_grad():
        q = rope_cache_write(flat["q"].view(B, -1, d), flat["k"].view(B, -1, d),
                             flat["v"].view(B, -1, d), cos[:, 0], sin[:, 0], ck, cv, slots,
                             q_norm=params[0], k_norm=params[1])
    return q, ck, cv


def _norm_eps(dtype, y_dtype, d):
    """ε_y of the module docstring: |y' - y| <= ε_y |y| for the Qwen3-normed values."""
    ux, uy = UNIT[dtype], UNIT[y_dtype]
    eps_n = (2 * ux + (d + 8) * 2.0**-24 + 2 * 2.0**-24) * (1 + ux)
    return (eps_n + uy * (2 + eps_n)) * (1 + 2 * uy)


def _rope_bound(y, cos, sin, eps_y, u):
    """(ε_y + 4u)(1 + ε_y)(1 + u) · T, T_i = |y_i cos_i| + |y_j sin_i| (y (B, H, D) the
    reference's normed values, cos / sin (B, D))."""
    y = y.double().abs()
    half = y.shape[-1] // 2
    partner = torch.cat([y[..., half:], y[..., :half]], -1)
    t = y * cos.double().abs()[:, None] + partner * sin.double().abs()[:, None]
    return (eps_y + 4 * u) * (1 + eps_y) * (1 + u) * t


def _check(name, *, hkv, g, d, dtype, batch, norm_dtype=None, device="cpu"):
    module, flat, cos, sin, cache, slots, norms = _parts(
        name, hkv=hkv, g=g, d=d, dtype=dtype, batch=batch, norm_dtype=norm_dtype)
    flat = {n: t.to(device) for n, t in flat.items()}
    cos, sin, slots = cos.to(device), sin.to(device), slots.to(device)
    cache = [c.to(device) for c in cache]
    norms = None if norms is None else [n.to(device) for n in norms]
    q_ref, ck_ref, cv_ref, (yq, yk) = _reference(module, flat, cos, sin, cache, slots, norms, d)
    q, ck, cv = _ours(flat, cos, sin, cache, slots, norms, d)
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape
    assert torch.equal(cv, cv_ref)  # v is copied: every slot bit for bit
    if norms is None:
        assert torch.equal(q, q_ref), (q - q_ref).abs().max()
        assert torch.equal(ck, ck_ref), (ck - ck_ref).abs().max()
        return
    eps_y = _norm_eps(dtype, yq.dtype, d)
    u = UNIT[q_ref.dtype]
    bound_q = _rope_bound(yq[:, :, 0], cos[:, 0], sin[:, 0], eps_y, u)
    err = (q.double() - q_ref.double()).abs()
    assert (err <= bound_q).all(), (err - bound_q).max()
    # the cache: written slots within the bound (plus the cast to the cache dtype, one rounding
    # each side), every other slot untouched
    rows = torch.arange(batch, device=device)
    written = torch.zeros_like(ck, dtype=torch.bool)
    written[rows, :, slots] = True
    assert torch.equal(ck[~written], ck_ref[~written])
    uc = UNIT[ck.dtype]
    bound_k = _rope_bound(yk[:, :, 0], cos[:, 0], sin[:, 0], eps_y, u) * (1 + uc) + \
        2 * uc * (1 + 2 * uc) * ck_ref[rows, :, slots].double().abs()
    err_k = (ck[rows, :, slots].double() - ck_ref[rows, :, slots].double()).abs()
    assert (err_k <= bound_k).all(), (err_k - bound_k).max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
# every family and rope type in the default suite (d = 64; g = 1 and 4); d = 128 (also in
# test_odd_batches_and_group_sizes) and g = 8 slow
@pytest.mark.parametrize("d", [64, pytest.param(128, marks=pytest.mark.slow)])
@pytest.mark.parametrize("g", [1, 4, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(ROPES))
def test_matches_transformers(name, g, d, dtype):
    """Every family / rope type x GQA ratio (Llama-3 8B and Mistral: 4; Qwen2.5-7B: 7, below)
    x head dim (Llama-3.2-1B 64, 8B 128) x dtype, 5 rows (odd) with slots 0, mid and last."""
    _check(name, hkv=2, g=g, d=d, dtype=dtype, batch=5)


@pytest.mark.parametrize("batch", [1, 3, pytest.param(9, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["llama-3.2", "qwen2", "qwen3"])
def test_odd_batches_and_group_sizes(name, batch):
    """Odd B; G = 7 (Qwen2.5-7B, -0.5B: 28 / 4 and 14 / 2 heads: a masked query-head block) and
    Hkv = 1; head dim 80 (a masked half-dim block) for the non-normed families."""
    _check(name, hkv=1, g=7, d=128, dtype=torch.bfloat16, batch=batch)
    if name != "qwen3":
        _check(name, hkv=3, g=2, d=80, dtype=torch.bfloat16, batch=batch)


def test_fp16_and_fp32_norm_weights():
    """fp16 models; Qwen3 norms with fp32 weights over bf16 states (prepare_model_for_kbit_training
    leaves norms in fp32): y is then fp32 by type promotion, so are the rotated q and k, and k is
    rounded to the bf16 cache."""
    _check("llama-3.1", hkv=2, g=4, d=64, dtype=torch.float16, batch=3)
    _check("qwen3", hkv=2, g=4, d=128, dtype=torch.float16, batch=3)
    _check("qwen3", hkv=2, g=4, d=128, dtype=torch.bfloat16, batch=3, norm_dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_qwen3_norm_alone(dtype):
    """cos = 1, sin = 0 makes the rotation the identity (y·1 and y·0 are exact), so the output is
    the kernel's q_norm / k_norm itself: within ε_y of Qwen3RMSNorm, elementwise; a wrong eps,
    weight or mean would be off by far more."""
    _, flat, cos, sin, cache, slots, norms = _parts("qwen3", hkv=2, g=4, d=128, dtype=dtype,
                                                    batch=5)
    cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
    q, ck, _ = _ours(flat, cos, sin, cache, slots, norms, 128)
    with torch.no_grad():
        yq = norms[0](flat["q"].view(5, -1, 128))
        yk = norms[1](flat["k"].view(5, -1, 128))
    eps_y = _norm_eps(dtype, dtype, 128)
    assert ((q.double() - yq.double()).abs() <= eps_y * yq.double().abs()).all()
    kw = ck[torch.arange(5), :, slots]
    assert ((kw.double() - yk.double()).abs() <= eps_y * yk.double().abs()).all()
    # and the eps is read: ε = 1 shrinks rows of mean x² ~ 4 by ~10 %
    wide = [copy.deepcopy(n) for n in norms]
    for n in wide:
        n.variance_epsilon = 1.0
    q_eps, _, _ = _ours(flat, cos, sin, cache, slots, wide, 128)
    assert not torch.allclose(q_eps.double(), yq.double(), rtol=0.05)


def test_torch_path_is_transformers_bit_for_bit():
    module, flat, cos, sin, cache, slots, norms = _parts("qwen3", hkv=2, g=4, d=64,
                                                         dtype=torch.bfloat16, batch=5)
    q_ref, ck_ref, cv_ref, _ = _reference(module, flat, cos, sin, cache, slots, norms, 64)
    ck, cv = cache[0].clone(), cache[1].clone()
    with torch.no_grad():
        q = rope_cache_write_torch(
            flat["q"].view(5, -1, 64), flat["k"].view(5, -1, 64), flat["v"].view(5, -1, 64),
            cos[:, 0], sin[:, 0], ck, cv, slots, q_norm=(norms[0].weight, 1e-6),
            k_norm=(norms[1].weight, 1e-6))
    assert torch.equal(q, q_ref) and torch.equal(ck, ck_ref) and torch.equal(cv, cv_ref)


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "qwen3"])
def test_tables_read_each_rows_slot(norm, monkeypatch, device="cpu"):
    """`tables`: cos / sin (P, D) over positions, row b's at slots_b, bit for bit the same call
    with the rows gathered (cos[slots]); and on the torch path. A wrong row would rotate by
    another position's angles."""
    g = torch.Generator().manual_seed(3)
    B, Hkv, G, D, M = 5, 2, 4, 64, 11
    q, k, v = (torch.randn(B, h, D, generator=g).to(device, torch.bfloat16)
               for h in (Hkv * G, Hkv, Hkv))
    angles = torch.arange(M)[:, None] * torch.rand(D // 2, generator=g)[None]
    cos = torch.cat([angles.cos()] * 2, 1).to(device, torch.bfloat16)  # (M, D)
    sin = torch.cat([angles.sin()] * 2, 1).to(device, torch.bfloat16)
    slots = torch.tensor([0, 7, 3, M - 1, 7], device=device)
    norms = {}
    if norm:
        w = (1 + torch.rand(D, generator=g)).to(device, torch.bfloat16)
        norms = {"q_norm": (w, 1e-6), "k_norm": (w.flip(0), 1e-6)}
    caches = [torch.zeros(B, Hkv, M, D, device=device, dtype=torch.bfloat16) for _ in range(4)]
    out = rope_cache_write(q, k, v, cos, sin, caches[0], caches[1], slots, tables=True, **norms)
    ref = rope_cache_write(q, k, v, cos[slots], sin[slots], caches[2], caches[3], slots, **norms)
    assert torch.equal(out, ref) and torch.equal(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])
    if device == "cpu":  # the torch path (no interpreter) takes the same tables
        from trainers.sampling.kernels import rope

        monkeypatch.setattr(rope, "interpreting", lambda: False)
        torch_caches = [c.zero_() for c in caches]
        torch_out = rope_cache_write(q, k, v, cos, sin, *torch_caches[:2], slots, tables=True,
                                     **norms)
        torch_ref = rope_cache_write_torch(q, k, v, cos[slots], sin[slots], *torch_caches[2:],
                                           slots, **norms)
        assert torch.equal(torch_out, torch_ref) and torch.equal(torch_caches[0], torch_caches[2])
    with pytest.raises(ValueError, match=r"must be \(P, D\)"):
        rope_cache_write(q, k, v, cos[:, :8], sin[:, :8], caches[0], caches[1], slots,
                         tables=True)


def test_bad_inputs():
    B, D = 2, 8
    q, k = torch.zeros(B, 4, D), torch.zeros(B, 2, D)
    cs = torch.zeros(B, D)
    cache = torch.zeros(B, 2, 5, D)
    slots = torch.zeros(B, dtype=torch.long)

    def call(**kw):
        a = {"q": q, "k": k, "v": k, "cos": cs, "sin": cs, "cache_k": cache, "cache_v": cache,
             "slots": slots}
        a.update(kw)
        return rope_cache_write(**a)

    with pytest.raises(ValueError, match=r"k \(2, 2, 4\)"):
        call(k=torch.zeros(B, 2, 4), v=torch.zeros(B, 2, 4))
    with pytest.raises(ValueError, match="q has 4 heads of dim 8, k has 3"):
        call(k=torch.zeros(B, 3, D), v=torch.zeros(B, 3, D))
    with pytest.raises(ValueError, match="rotary dim below"):
        call(cos=torch.zeros(B, D // 2), sin=torch.zeros(B, D // 2))
    with pytest.raises(ValueError, match=r"cache_k \(2, 2, 5, 4\)"):
        call(cache_k=torch.zeros(B, 2, 5, 4), cache_v=torch.zeros(B, 2, 5, 4))
    with pytest.raises(ValueError, match="slots is"):
        call(slots=slots.float())
    with pytest.raises(ValueError, match="go together"):
        call(q_norm=(torch.ones(D), 1e-6))
    with pytest.raises(ValueError, match=r"q_norm weight is \(4,\)"):
        call(q_norm=(torch.ones(4), 1e-6), k_norm=(torch.ones(D), 1e-6))
    with pytest.raises(ValueError, match="head dim must be contiguous"):
        wide = torch.zeros(B, 2, 5, 2 * D)[..., ::2]
        call(cache_k=wide, cache_v=wide)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(8, 4, 64), (8, 4, 128), (4, 7, 128), (8, 1, 128)],
                         ids=["1b", "8b", "qwen7b", "mha"])
@pytest.mark.parametrize("name", ["llama-3.1", "llama-3.2", "qwen2", "mistral", "qwen3"])
@pytest.mark.parametrize("batch", [1, 8, 61])
def test_matches_transformers_gpu(name, shape, dtype, batch):
    """The same checks on CUDA tensors: the compiled kernel (fp contraction off) against
    transformers' CUDA ops, bit for bit without q/k norms, within the bound with them."""
    hkv, g, d = shape
    _check(name, hkv=hkv, g=g, d=d, dtype=dtype, batch=batch, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "qwen3"])
def test_tables_read_each_rows_slot_gpu(norm, monkeypatch):
    test_tables_read_each_rows_slot(norm, monkeypatch, device="cuda")
