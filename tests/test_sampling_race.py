"""trainers.sampling.kernels.race: the sampling step's reductions split over programs, against
fp64 and against `processors.sample`'s torch ops. CPU: Triton's interpreter; `-m gpu`: compiled.

Tolerances (race's module docstring): lse is a sum of V exponentials in fp32 in some order,
|Δ lse| ≤ (V + S + 4) · 2⁻²⁴ + ulp(lse) against fp64, S = ⌈V / 4096⌉ chunks; log p = z_y − lse
adds ulp(log p). A wrong max, chunk weight or index is off by O(1).

    python -m pytest -q tests/test_sampling_race.py
"""

import math

import pytest
import torch

from trainers.sampling import processors
from trainers.sampling.kernels.race import BLOCK, race_sample

U32 = 2.0**-24


def _logp_tol(z64: torch.Tensor, lse64: torch.Tensor) -> torch.Tensor:
    V = z64.shape[1]
    S = math.ceil(V / BLOCK)
    return (V + S + 4) * U32 + 2 * U32 * (2 * lse64.abs() + z64.abs().amax(-1))


def _logits(B, V, seed, device="cpu", scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, V, generator=g) * scale).to(device)


@pytest.mark.parametrize("B,V", [(1, 7), (3, 4096), (5, 4097), (2, 10000), (8, 12289)])
def test_greedy_is_argmax_with_exact_logprob(B, V, device="cpu"):
    """Greedy: torch's argmax (ties to the first index: row 0 holds its max twice) and
    z_y − lse within the fp32 bound of fp64; chunks of -inf only (truncation) and a row whose
    only finite logits are in its last chunk."""
    z = _logits(B, V, seed=V, device=device)
    z[0, V // 2] = z[0, -1] = z[0].max() + 1  # a tie: the first index wins
    if V > BLOCK:
        z[1, :BLOCK] = float("-inf")  # a whole chunk truncated
        z[-1, : V - 1] = float("-inf")  # one finite logit, in the last (partial) chunk
    y, lp = race_sample(z, None)
    assert y.dtype == torch.int64 and lp.dtype == torch.float32 and y.shape == lp.shape == (B,)
    assert torch.equal(y, z.argmax(-1))
    z64 = z.double()
    lse = torch.logsumexp(z64, -1)
    ref = z64.gather(1, y[:, None])[:, 0] - lse
    assert ((lp.double() - ref).abs() <= _logp_tol(z64, lse)).all(), (lp, ref)


@pytest.mark.parametrize("B,V", [(4, 9), (3, 5000), (2, 12289)])
def test_race_wins_the_race_with_its_draws(B, V, device="cpu"):
    """Sampling with given Exp(1) draws: the token's fp64 race score (log p − log E) is the
    row's best within the bound (a near-tie may go either way), and its log-prob is exact;
    tiny draws (clamped to 1e-30) and truncated tokens (never drawn)."""
    z = _logits(B, V, seed=V + 1, device=device, scale=1.0)
    g = torch.Generator().manual_seed(V)
    E = torch.empty(B, V).exponential_(generator=g).to(device)
    E[0, 3] = 0.0  # clamped: a huge score for token 3 of row 0, which must win
    z[1, : V // 2] = float("-inf")  # truncated half: never drawn
    E[1, 0] = 0.0
    y, lp = race_sample(z, E)
    z64 = z.double()
    lse = torch.logsumexp(z64, -1, keepdim=True)
    score = (z64 - lse) - E.double().clamp_min(1e-30).log()
    got = score.gather(1, y[:, None])[:, 0]
    tol = _logp_tol(z64, lse[:, 0]) + 4 * U32 * score.abs().amax(-1)
    assert (got >= score.amax(-1) - tol).all()
    assert y[0] == 3 and y[1] >= V // 2
    ref = z64.gather(1, y[:, None])[:, 0] - lse[:, 0]
    assert ((lp.double() - ref).abs() <= _logp_tol(z64, lse[:, 0])).all()


def test_processors_sample_fused_equals_torch_ops():
    """`processors.sample(fused=True)` draws the same Exp(1) numbers as the torch path (same
    generator state): the same tokens on well-separated rows, log-probs within the bound."""
    z = _logits(6, 6000, seed=3)
    spec = processors.SamplingSpec(True, 1.0, 0, 1.0, None, 1.0)
    torch.manual_seed(11)
    y_ref, lp_ref = processors.sample(z, spec)
    torch.manual_seed(11)
    y, lp = processors.sample(z, spec, fused=True)
    assert torch.equal(y, y_ref)
    lse = torch.logsumexp(z.double(), -1)
    assert ((lp - lp_ref).double().abs() <= 2 * _logp_tol(z.double(), lse)).all()


@pytest.mark.slow  # 3000 rows: the interpreter runs each row's programs one by one
def test_frequencies_follow_the_softmax():
    """The kernels' race over fresh draws samples softmax(z): chi-square over V = 6 tokens,
    N = 3000 draws (rows of one logit vector). The statistic has 5 degrees of freedom; the
    test fails above 25.7, the 0.9999 quantile (false alarm 1e-4), with a fixed seed."""
    V, N = 6, 3000
    z = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5, -3.0]]).expand(N, V).contiguous()
    g = torch.Generator().manual_seed(1234)
    E = torch.empty(N, V).exponential_(generator=g)
    y, _ = race_sample(z, E)
    counts = torch.bincount(y, minlength=V).double()
    expect = torch.softmax(z[0].double(), 0) * N
    chi2 = ((counts - expect) ** 2 / expect).sum().item()
    assert chi2 < 25.7, (counts, expect)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="z has shape"):
        race_sample(torch.zeros(3, 4, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match="draws has shape"):
        race_sample(torch.zeros(3, 4), torch.zeros(3, 5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B,V", [(8, 128256), (64, 128256), (3, 151936), (5, 4097)])
def test_gpu(B, V):
    """Compiled, at the Llama-3 and Qwen vocabularies and decode batches."""
    test_greedy_is_argmax_with_exact_logprob(B, V, "cuda")
    test_race_wins_the_race_with_its_draws(B, V, "cuda")
