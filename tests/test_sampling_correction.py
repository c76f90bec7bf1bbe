"""trainers.sampling.correction: the decode loop's sampling log-probs in TRL 1.16's
importance-sampling correction, without vLLM (trainers.GRPOTrainer).

The loop is the test double of tests/_fake_loop.py: greedy HF `generate` at τ = 1, whose
log-probs are the exact ones (log_softmax of the logits) plus a known shift s(b, t). TRL's
old-policy pass recomputes the exact log-probs, so δ = old − sampling = −s up to fp32 rounding,
and every quantity TRL derives has a value computed here by hand from s alone:

    token_* modes:     ρ_bt = exp(−s_bt)            sequence_* modes: ρ_b = exp(−Σ_t s_bt m_bt)
    *_truncate:        clamp(ρ, C_min, C_max)       *_mask: ρ · [C_min ≤ ρ ≤ C_max]
    metrics:           mean / max of |s| over the completion tokens; min / mean / max of ρ
    loss ("grpo", on-policy, β = 0, so the clipped ratio is 1): mean_b(−A_b Σ_t ρ_bt m_bt / Σ m_b)

Covered: all four modes, through `_generate_and_score_completions` and `_compute_loss`, with ρ
from TRL's old-policy pass (num_iterations = 2, where TRL runs that pass) and from the loss's
policy pass (num_iterations = 1, the default, where scoring runs no forward at all); the
gate closed afterwards; with the switch off, TRL's outputs and metrics exactly as with TRL's own
sampling (no log-probs, no correction); a call the loop did not serve gets no correction.

Tolerances. The exact log-probs come from HF's forward (logits then log_softmax, fp32) and from
the trainer's fused head (fp32 GEMM and lse): equal to fp32 rounding of logits ~16 in size,
|δ + s| ≤ 5e-5 per token (the trainer tests' LOGP_ATOL). A sequence sums ≤ NEW = 6 tokens:
≤ 3e-4 in the exponent, so ratios are compared at rtol 5e-4; the shifts are chosen so that no
exponent lies within 1e-2 of a clip bound (asserted), so no mask or clamp decision can flip.

    python -m pytest tests/test_sampling_correction.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
import trl
from _fake_loop import FakeCompiled, FakeDecodeLoop
from _tiny_models import lora_tiny_llama
from datasets import Dataset

from trainers import GRPOTrainer
from trainers.tiny import build_tokenizer

NEW = 6
C_MIN, C_MAX = 0.5, 2.0
SHIFTS = (-1.0, -0.3, 0.2, 0.9)  # δ = 1.0, 0.3, -0.2, -0.9: above, inside, inside, below
PROMPTS = ["1+1=", "1+1=", "abc", "abc"]  # one generation batch: 2 prompts x 2 generations
LOGP_ATOL = 5e-5
RATIO_RTOL = 5e-4


def shift(b: int, t: int) -> float:
    return SHIFTS[(3 * b + t) % len(SHIFTS)]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _reward(completions, **kwargs):
    # varies within each prompt's group although greedy completions repeat: advantages ≠ 0
    return [float(i % 2) + 0.25 * i for i in range(len(completions))]


def _trainer(tok, tmp_path, *, mode="token_truncate", correction=None, sampler="auto",
             loop=None, num_iterations=1):
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
        per_device_train_batch_size=4, num_generations=2, max_completion_length=NEW,
        save_strategy="no", seed=0, beta=0.0, loss_type="grpo", num_iterations=num_iterations,
        generation_kwargs={"do_sample": False}, vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=C_MIN, vllm_importance_sampling_clip_max=C_MAX)
    kw = {} if correction is None else {"sampler_importance_sampling_correction": correction}
    tr = GRPOTrainer(model=lora_tiny_llama(tok), args=args, processing_class=tok,
                     train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                     reward_funcs=_reward, sampler=sampler, **kw)
    tr._lce_samplers.loop = loop if loop is not None else FakeDecodeLoop(shift=shift)
    tr._lce_sampler = FakeCompiled()
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1  # what Trainer.train sets per optimizer step
    return tr


def _score(tr):
    return tr._generate_and_score_completions([{"prompt": p} for p in PROMPTS])


def _padded(rows, width, fill=0.0):
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows])


def _hand_ratio(mode, s, m):
    """ρ by the module docstring's formulas from the shifts s (B, T) and the mask m."""
    log_rho = -s * m
    if mode.startswith("sequence"):
        log_rho = log_rho.sum(-1, keepdim=True)
    lo, hi = math.log(C_MIN), math.log(C_MAX)
    margin = torch.minimum((log_rho - lo).abs(), (log_rho - hi).abs())
    assert margin.min() > 1e-2, "the test's shifts put an exponent on a clip bound"
    rho = log_rho.exp()
    if mode.endswith("truncate"):
        return rho.clamp(C_MIN, C_MAX)
    return rho * ((rho >= C_MIN) & (rho <= C_MAX))


class _PassCounter:
    """Counts the trainer's log-prob passes (`_lce_logps_and_entropies`)."""

    def __init__(self, tr):
        self.calls = 0
        inner = tr._lce_logps_and_entropies

        def counted(*args, **kwargs):
            self.calls += 1
            return inner(*args, **kwargs)

        tr._lce_logps_and_entropies = counted


def _expected_metrics(deltas, mode, rho, valid):
    """TRL's sampling/* metrics by hand: |δ| over the tokens counted (`deltas`), ρ over the
    valid tokens (token_* modes) or the rows (sequence_*)."""
    flat = rho.flatten() if mode.startswith("sequence") else rho[valid]
    return {
        "sampling/sampling_logp_difference/mean": deltas.mean().item(),
        "sampling/sampling_logp_difference/max": deltas.max().item(),
        "sampling/importance_sampling_ratio/min": flat.min().item(),
        "sampling/importance_sampling_ratio/mean": flat.mean().item(),
        "sampling/importance_sampling_ratio/max": flat.max().item(),
    }


def _sampling_metrics(tr):
    return {k: v[-1] for k, v in tr._metrics["train"].items() if k.startswith("sampling/")}


@pytest.mark.parametrize("source", ["old_pass", "loss_pass"])
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate",
                                  "sequence_mask"])
def test_loop_logprobs_drive_trls_correction(tok, tmp_path, mode, source):
    tr = _trainer(tok, tmp_path, mode=mode, num_iterations=2 if source == "old_pass" else 1)
    assert tr._lce_correction.defers() is (source == "loss_pass")
    passes = _PassCounter(tr)
    out = _score(tr)
    loop = tr._lce_samplers.loop
    assert loop.stats.calls == 1 and tr._lce_samplers.served["loop"] == 1  # our path ran
    (ret,) = loop.returned
    m = out["completion_mask"].float()
    B, T = m.shape
    assert out["completion_ids"].tolist() == _padded(ret.token_ids, T, tok.pad_token_id).long(
    ).tolist()

    # TRL padded our log-probs into sampling_per_token_logps
    torch.testing.assert_close(out["sampling_per_token_logps"], _padded(ret.logprobs, T),
                               rtol=0, atol=0)
    s = torch.tensor([[shift(b, t) for t in range(T)] for b in range(B)]) * m
    rho = _hand_ratio(mode, s, m)
    valid = m.bool()
    expect = _expected_metrics(s.abs()[valid], mode, rho, valid)

    if source == "old_pass":
        assert passes.calls == 1  # TRL's old-policy pass
        # it recomputed the exact log-probs: δ = −s
        exact = out["sampling_per_token_logps"] - s
        torch.testing.assert_close(out["old_per_token_logps"] * m, exact * m, rtol=0,
                                   atol=LOGP_ATOL)
        torch.testing.assert_close(out["importance_sampling_ratio"], rho, rtol=RATIO_RTOL,
                                   atol=0)
        metrics = _sampling_metrics(tr)
    else:
        assert passes.calls == 0  # scoring ran no forward (β = 0)
        assert not {"old_per_token_logps", "importance_sampling_ratio"} & out.keys()
        assert not _sampling_metrics(tr)
    # the gate is closed again
    assert tr.use_vllm is False and tr.vllm_importance_sampling_correction is True

    # _compute_loss applies ρ: the "grpo" loss by hand (ratio to the old policy = 1)
    A = out["advantages"]
    assert A.abs().max() > 0.1
    loss = tr._compute_loss(tr.model, out)
    hand = (-(A[:, None] * rho * m).sum(-1) / m.sum(-1)).mean()
    torch.testing.assert_close(loss.detach(), hand, rtol=RATIO_RTOL, atol=1e-6)
    assert tr.use_vllm is False
    if source == "loss_pass":
        assert passes.calls == 1  # the loss's policy pass, which ρ came from
        assert "importance_sampling_ratio" not in out  # added to the loss's own inputs
        metrics = _sampling_metrics(tr)
    assert metrics.keys() == expect.keys()
    for k, v in expect.items():
        assert metrics[k] == pytest.approx(v, rel=RATIO_RTOL, abs=LOGP_ATOL), k

    drop = {"importance_sampling_ratio", "sampling_per_token_logps"}
    without = tr._compute_loss(tr.model, {k: v for k, v in out.items() if k not in drop})
    assert not torch.allclose(without, loss, rtol=1e-3), "the ratio must change the loss"


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate",
                                  "sequence_mask"])
def test_ratio_from_the_loss_pass_masks_and_skips_nans(tok, tmp_path, mode):
    """ρ from the loss's policy pass on a batch with padding, tool tokens and a NaN sampling
    log-prob: they get δ = 0 and stay out of the metrics, whatever their log-probs hold."""
    tr = _trainer(tok, tmp_path, mode=mode)
    g = torch.Generator().manual_seed(0)
    B, T = 4, 7
    completion_mask = torch.ones(B, T, dtype=torch.long)
    completion_mask[1, 4:] = 0
    completion_mask[3, 2:] = 0
    tool_mask = torch.ones(B, T, dtype=torch.long)
    tool_mask[2, 1:3] = 0
    policy = -torch.rand(B, T, generator=g) * 3
    sampling = policy + (torch.rand(B, T, generator=g) - 0.5) * 0.6  # |δ| ≤ 0.3
    sampling[0, 5] = float("nan")
    m = completion_mask * tool_mask
    sampling[m == 0] += 50.0  # what masked positions hold must not matter
    inputs = {"completion_mask": completion_mask, "tool_mask": tool_mask,
              "sampling_per_token_logps": sampling}
    with tr._lce_correction.loss(inputs):
        assert tr.use_vllm is True
        tr._lce_correction.policy_logprobs(policy.clone().requires_grad_())
    assert tr.use_vllm is False

    known = (m == 1) & ~sampling.isnan()
    delta = torch.where(known, policy.double() - sampling.double(), 0.0)
    log_rho = delta.sum(-1, keepdim=True) if mode.startswith("sequence") else delta
    rho = log_rho.exp()
    rho = rho.clamp(C_MIN, C_MAX) if mode.endswith("truncate") else rho * (
        (rho >= C_MIN) & (rho <= C_MAX))
    got = inputs["importance_sampling_ratio"]
    assert not got.requires_grad
    torch.testing.assert_close(got.double(), rho, rtol=1e-6, atol=0)
    expect = _expected_metrics(delta.abs()[known], mode, rho, m == 1)
    metrics = _sampling_metrics(tr)
    assert metrics.keys() == expect.keys()
    for k, v in expect.items():
        assert metrics[k] == pytest.approx(v, rel=1e-6), k


def test_switch_off_leaves_trls_behaviour(tok, tmp_path):
    """With the switch off, a loop-served call scores exactly as TRL's own sampling does."""
    outs, metrics = [], []
    for sampler, correction in (("auto", False), ("trl", None)):
        tr = _trainer(tok, tmp_path, correction=correction, sampler=sampler)
        torch.manual_seed(0)
        outs.append(_score(tr))
        metrics.append({k: v[-1] for k, v in tr._metrics["train"].items()
                        if not k.startswith(("timing/", "fast_generation/"))})
        served = tr._lce_samplers.served
        assert served["loop"] == (1 if sampler == "auto" else 0)
    ours, trls = outs
    assert ours.keys() == trls.keys()
    assert not {"importance_sampling_ratio", "sampling_per_token_logps"} & ours.keys()
    for k in ours:
        if isinstance(ours[k], torch.Tensor):
            assert torch.equal(ours[k], trls[k]), k
    assert metrics[0].keys() == metrics[1].keys()
    assert not any(k.startswith("sampling/") for k in metrics[0])


def test_call_not_served_by_the_loop_gets_no_correction(tok, tmp_path):
    tr = _trainer(tok, tmp_path, loop=FakeDecodeLoop(unsupported="not this model"))
    out = _score(tr)
    assert tr._lce_samplers.served["compiled"] == 1
    assert not {"importance_sampling_ratio", "sampling_per_token_logps"} & out.keys()
    assert not any(k.startswith("sampling/") for k in tr._metrics["train"])


@pytest.mark.parametrize("others", [True, False])
def test_processes_agree_before_feeding_logprobs(tok, tmp_path, monkeypatch, caplog, others):
    """Several processes: the first turn of a call asks all of them once (`all_processes`,
    here answered for another process whose loop did or did not serve) and feeds log-probs only
    where every process does; a call the loop did not serve asks too (with False), since the
    others' turns wait for its answer."""
    from trainers.sampling import correction

    asked = []

    def all_processes(flag, accelerator):
        asked.append(flag)
        return flag and others

    monkeypatch.setattr(correction, "all_processes", all_processes)
    tr = _trainer(tok, tmp_path)
    with caplog.at_level("WARNING"):
        out = _score(tr)
        out2 = _score(tr)
    assert asked == [True, True]  # one question per generation call
    assert ("sampling_per_token_logps" in out) == others == ("sampling_per_token_logps" in out2)
    disagreed = [r for r in caplog.records if "another process's decode loop" in r.getMessage()]
    assert len(disagreed) == (0 if others else 1)  # logged once
    assert not tr.use_vllm and tr._lce_correction._gate._saved is None  # the gate closed
    for unserved in (_trainer(tok, tmp_path, loop=FakeDecodeLoop(unsupported="not this model")),
                     _trainer(tok, tmp_path, sampler="trl")):  # FastSampler, TRL's generate
        asked.clear()
        assert "sampling_per_token_logps" not in _score(unserved)
        assert asked == [False]


def test_all_processes_is_the_minimum_over_processes():
    """One process answers alone (no collective); several: the minimum of the gathered flags."""
    from types import SimpleNamespace

    from trainers.sampling.correction import all_processes

    def acc(n, others):
        return SimpleNamespace(num_processes=n, device="cpu", gather=lambda t: torch.cat(
            [t, torch.tensor(others, dtype=t.dtype)]))

    assert all_processes(True, SimpleNamespace(num_processes=1)) is True
    assert all_processes(False, SimpleNamespace(num_processes=1)) is False
    assert all_processes(True, acc(3, [1, 1])) is True
    assert all_processes(True, acc(3, [1, 0])) is False
    assert all_processes(False, acc(2, [1])) is False
