"""A decode step with no cuBLAS call: the LM head by `head_logits`, RoPE's cos / sin by
`ModelStep.rope_table`. CPU: Triton's interpreter; `-m gpu`: compiled.

head_logits: z = fp32(round_dtype(s)), s the fp32 sum of the H exact products x_h·w_h. Against
the exact (fp64) value e: |s − e| ≤ γ_H Σ_h |x_h w_h| with γ_H = H·2⁻²⁴ (any summation order),
and rounding to the dtype adds at most u·|s| (u = 2⁻⁸ bf16, 2⁻¹¹ fp16, relative half-ulp),
so |z − e| ≤ u·|e| + (1 + u)·γ_H·Σ|x w| (+ the dtype's smallest subnormal spacing near 0).
A wrong tile offset, row stride or mask is off by the size of a logit.

rope_table: each entry is the module's own value at that position (one fp32 product per entry,
then cos / sin), so a table row equals `rotary_emb(x, positions)` bit for bit.
"""

import pytest
import torch
import transformers
from test_decode_rope import MAX_POS, ROPES

from trainers.sampling.kernels.head_logits import BLOCK_V, head_logits, head_reason
from trainers.sampling.model_step import STATIC_ROPE, ModelStep

UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
TINY = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}  # subnormal spacing


def _head(H, V, dtype, seed, device="cpu"):
    """A bias-free (V, H) head of std H^-1/2 weights: logits of a few units for inputs of std 2."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False)
    head.weight.data = (torch.randn(V, H, generator=g) * H**-0.5).to(dtype)
    return head.to(device)


def _assert_within_rounding(z, x, w):
    e = x.double() @ w.double().T
    mass = x.double().abs() @ w.double().abs().T
    u = UNIT[w.dtype]
    H = x.shape[1]
    bound = u * e.abs() + (1 + u) * H * 2.0**-24 * mass + TINY[w.dtype]
    err = (z.double() - e).abs()
    assert (err <= bound).all(), (err - bound).max()


@pytest.mark.parametrize("B,H,V", [(1, 64, 7), (3, 128, 1000), (8, 96, BLOCK_V + 1),
                                   (20, 256, 3 * BLOCK_V), (70, 130, 517)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_head_logits_within_rounding_of_fp64(B, H, V, dtype, device="cpu"):
    """Odd batch (70: two row blocks), H not a multiple of the H block (96, 130), V across
    vocabulary tiles; the module's own output within the same bound; shape and dtype."""
    head = _head(H, V, dtype, seed=V)
    g = torch.Generator().manual_seed(B)
    x = (torch.randn(B, H, generator=g) * 2).to(dtype)
    head, x = head.to(device), x.to(device)
    assert head_reason(head, dtype) is None
    z = head_logits(x, head)
    assert z.dtype == torch.float32 and z.shape == (B, V)
    _assert_within_rounding(z.cpu(), x.cpu(), head.weight.cpu())
    # every value is a dtype value, as the module's output is
    assert torch.equal(z, z.to(dtype).float())
    _assert_within_rounding(head(x).float().cpu(), x.cpu(), head.weight.cpu())


def test_head_logits_reads_strided_rows():
    """x as a row slice of a wider buffer (the decode step passes views)."""
    head = _head(64, 300, torch.bfloat16, seed=3)
    wide = torch.randn(5, 80).to(torch.bfloat16)
    x = wide[:, 8:72]
    assert x.stride(0) == 80
    _assert_within_rounding(head_logits(x, head), x, head.weight)


def test_head_reason_and_errors():
    head = _head(32, 50, torch.bfloat16, seed=1)
    x = torch.randn(2, 32).to(torch.bfloat16)
    assert head_reason(head, torch.float16) == \
        "the LM head weight is torch.bfloat16 for torch.float16 inputs"
    biased = torch.nn.Linear(32, 50).to(torch.bfloat16)
    assert head_reason(biased, torch.bfloat16) == "the LM head has a bias"
    assert "not a plain nn.Linear" in head_reason(torch.nn.Embedding(50, 32), torch.float32)
    assert "torch.float32" in head_reason(torch.nn.Linear(32, 50, bias=False), torch.float32)
    with pytest.raises(ValueError, match="x has shape"):
        head_logits(x[:, :16], head)
    with pytest.raises(ValueError, match="x has shape"):
        head_logits(x.float(), head)


def _rope_model(name):
    module, rope = ROPES[name]
    prefix = {"modeling_llama": "Llama", "modeling_qwen2": "Qwen2", "modeling_mistral":
              "Mistral", "modeling_qwen3": "Qwen3"}[module.__name__.rsplit(".", 1)[-1]]
    config = getattr(transformers, prefix + "Config")(
        vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=MAX_POS, rope_parameters=dict(rope))
    return getattr(transformers, prefix + "ForCausalLM")(config)


@pytest.mark.parametrize("name", [n for n, (_, r) in ROPES.items()
                                  if r["rope_type"] in STATIC_ROPE])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_table_rows_are_the_modules_values(name, dtype):
    """Rows of the table at decode positions (B, 1) and a prefill's (1, S) equal
    `rotary_emb` at those positions, bit for bit; the table is made once per (M, dtype)."""
    model = _rope_model(name)
    step = ModelStep(model)
    M = 9000  # past Llama-3's original 8192 positions
    x = torch.zeros(1, dtype=dtype)
    cos, sin = step.rope_table(M, x)
    assert cos.shape == sin.shape == (M, 16) and cos.dtype == dtype
    assert step.rope_table(M, x)[0] is cos and ModelStep(model).rope_table(M, x)[0] is cos
    g = torch.Generator().manual_seed(0)
    slots = torch.cat([torch.tensor([0, 1, 8191, M - 1]), torch.randint(0, M, (12,), generator=g)])
    ref_cos, ref_sin = model.model.rotary_emb(x, slots[:, None])  # (B, 1, D)
    assert torch.equal(cos[slots][:, None], ref_cos) and torch.equal(sin[slots][:, None], ref_sin)
    S = 37
    ref_cos, ref_sin = model.model.rotary_emb(x, torch.arange(S)[None])  # (1, S, D)
    assert torch.equal(cos[None, :S], ref_cos) and torch.equal(sin[None, :S], ref_sin)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B,H", [(8, 2048), (64, 2048), (8, 4096), (5, 3584)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_head_logits_at_model_shapes(B, H, dtype):
    """Llama-3.2-1B / 3.1-8B and Qwen2-7B head shapes (V = 128256 / 152064), compiled: within
    rounding of fp64 and of cuBLAS's own output."""
    V = 152064 if H == 3584 else 128256
    head = _head(H, V, dtype, seed=H, device="cuda")
    x = (torch.randn(B, H, device="cuda") * 2).to(dtype)
    z = head_logits(x, head)
    _assert_within_rounding(z.cpu(), x.cpu(), head.weight.cpu())
    _assert_within_rounding(head(x).float().cpu(), x.cpu(), head.weight.cpu())
