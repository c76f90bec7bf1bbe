"""trainers.RLOOTrainer against stock trl.RLOOTrainer 1.16 on tiny offline fp32 Llama and Qwen2.

Covers: per-token log-probs and entropies of TRL's `_get_per_token_logps_and_entropies` (which
calls the fused forward) for the policy, the adapter-disabled reference and a separate
`ref_model`, at τ = 1 and τ ≠ 1, tied and untied, in ragged row chunks; the loss, LoRA (and
full fine-tuning) gradients and metrics after one `compute_loss` + backward, with ε / ε_high
clipping exercised; a 3-step `train()` with generation, the KL penalty (β > 0, reference pass),
normalised advantages, reward clipping and off-policy steps, whose logs match stock TRL step by
step; the fallback for a softcapped model, with one logged line.

Every comparison runs ours inside `_trainer_pairs.fused_head_ran`, so it fails if ours fell back
to TRL's code (check: `PYTHONPATH=tests python -m pytest -p _force_fallback ...`,
tests/_force_fallback.py).

    python -m pytest tests/test_trainers_rloo.py -q

Tolerances: as in tests/test_trainers_grpo.py (fp32, bit-identical hidden states, two fp32 heads
summing in different orders): per-token log-probs and entropies atol 5e-5, loss and gradients within
3× of stock's own distance to the fp64 step, metrics rel 1e-5 / abs 2e-5, training logs rel 1e-4.
"""

from __future__ import annotations

import copy
import logging
from contextlib import nullcontext

import pytest
import torch
import trl
from _tiny_models import tiny_model
from _trainer_pairs import (
    assert_close,
    assert_same_logs,
    assert_same_step,
    fp64_step,
    fused_head_ran,
    fused_if_ours,
    loss_step,
    ragged_ids_and_mask,
    randomize_adapter,
)
from datasets import Dataset
from trl.trainer.utils import use_adapter

from trainers import RLOOTrainer
from trainers.tiny import build_tokenizer

LOGP_ATOL = 5e-5
METRIC_REL, METRIC_ABS = 1e-5, 2e-5

B, P, C = 4, 6, 9  # completions, prompt length, completion length (ragged via masks below)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _reward_digits(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def _reward_chars(completions, **kwargs):
    # varies between samples of one prompt even when every completion has the maximum length
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _dataset():
    return Dataset.from_dict({"prompt": ["1+1=", "2*3=", "abc", "xy z", "7-2=", "hi!"] * 4})


def _config(tmp_path, **overrides):
    kw = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
              per_device_train_batch_size=B, num_generations=B, max_completion_length=C,
              logging_steps=1, save_strategy="no", seed=0)
    kw.update(overrides)
    return trl.RLOOConfig(**kw)


def _pair(tok, tmp_path, model, **config):
    out = []
    for cls in (trl.RLOOTrainer, RLOOTrainer):
        tr = cls(model=copy.deepcopy(model), reward_funcs=[_reward_len, _reward_digits],
                 args=_config(tmp_path, **config), train_dataset=_dataset(),
                 processing_class=tok)
        tr.model.train()
        out.append(tr)
    return out


def _ids_and_mask(tok):
    return ragged_ids_and_mask(tok, P, C)  # (B, P + C), B = 4


@pytest.mark.parametrize("arch,tied,temperature", [("llama", True, 1.0), ("qwen2", False, 0.7)])
def test_logps_entropy_policy_and_reference_match_trl(tok, tmp_path, arch, tied, temperature):
    stock, ours = _pair(tok, tmp_path, tiny_model(tok, arch, tied=tied),
                        temperature=temperature)
    ids, mask = _ids_and_mask(tok)
    lps = {}
    for adapter in ("default", None):  # the policy, then the reference (adapter disabled)
        res = []
        for tr in (stock, ours):
            ctx = use_adapter(tr.model, adapter_name=None) if adapter is None else nullcontext()
            with ctx, fused_if_ours(tr):
                res.append(tr._get_per_token_logps_and_entropies(
                    tr.model, ids, mask, C, batch_size=3, compute_entropy=True))
        (lp_s, ent_s, _), (lp_o, ent_o, _) = res
        assert lp_o.shape == (B, C)
        assert_close(lp_o, lp_s, atol=LOGP_ATOL, what=f"logp adapter={adapter}")
        assert_close(ent_o, ent_s, atol=LOGP_ATOL, what=f"entropy adapter={adapter}")
        assert (lp_o[mask[:, P:] == 0] == 0).all() and (ent_o[mask[:, P:] == 0] == 0).all()
        lps[adapter] = lp_o
    assert (lps["default"] - lps[None]).abs().max() > 1e-3  # the reference really differs


def test_separate_reference_model_matches_trl(tok, tmp_path):
    # Full fine-tuning with β > 0: TRL builds `ref_model` from the policy's path; both trainers'
    # reference passes go through the fused forward at the sampling temperature.
    from trainers.tiny import tiny_model_dir

    path = tiny_model_dir(str(tmp_path / "tiny"), hidden_size=64, tie_word_embeddings=False)
    stock, ours = _pair(tok, tmp_path, path, beta=0.1, temperature=0.8)
    assert stock.ref_model is not None and ours.ref_model is not None
    ids, mask = _ids_and_mask(tok)
    with torch.no_grad():
        lp_s, _, _ = stock._get_per_token_logps_and_entropies(stock.ref_model, ids, mask, C)
        with fused_head_ran(ours):
            lp_o, _, _ = ours._get_per_token_logps_and_entropies(ours.ref_model, ids, mask, C)
    assert_close(lp_o, lp_s, atol=LOGP_ATOL, what="ref_model logp")


def _inputs(stock, tok, *, noise=0.3):
    """What `_generate_and_score_completions` hands to `compute_loss`; the old log-probs are
    the current ones plus noise (as after an optimizer step), so ratios leave the clip range."""
    ids, mask = _ids_and_mask(tok)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        lp, _, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, mask, C)
    old = (lp * mask[:, P:]).sum(1)
    return {
        "prompt_ids": ids[:, :P], "prompt_mask": mask[:, :P],
        "completion_ids": ids[:, P:], "completion_mask": mask[:, P:],
        "old_logps": old + noise * torch.randn(B, generator=g),
        "advantages": torch.randn(B, generator=g),
    }


_LOSS_CASES = [
    # arch, tied, peft, temperature, config
    ("llama", True, True, 1.0, {}),
    ("llama", False, True, 0.7, {"epsilon": 0.1, "epsilon_high": 0.28}),
    ("qwen2", True, True, 0.7, {"epsilon": 0.05}),
    ("qwen2", False, False, 1.0, {"epsilon": 0.2, "epsilon_high": 0.1, "beta": 0.0}),
]


@pytest.mark.parametrize("arch,tied,peft,temperature,config", _LOSS_CASES)
def test_loss_grads_and_metrics_match_trl(tok, tmp_path, arch, tied, peft, temperature, config):
    stock, ours = _pair(tok, tmp_path, tiny_model(tok, arch, tied=tied, peft=peft),
                        temperature=temperature, **config)
    inputs = _inputs(stock, tok)
    stock_step = loss_step(stock, inputs)
    with fused_head_ran(ours):
        ours_step = loss_step(ours, inputs)
    steps = stock_step, ours_step, fp64_step(stock, inputs)
    assert_same_step(*steps, metric_rel=METRIC_REL, metric_abs=METRIC_ABS, lora_only=peft)
    m = steps[0][2]
    assert m["clip_ratio/region_mean"][0] > 0  # the clipped branch was exercised


def test_softcapped_model_falls_back_with_one_line(tok, tmp_path, caplog):
    model = tiny_model(tok, tied=False)
    model.get_base_model().config.final_logit_softcapping = 5.0
    stock, ours = _pair(tok, tmp_path, model)
    ids, mask = _ids_and_mask(tok)
    with caplog.at_level(logging.WARNING, logger="trainers.rloo"), torch.no_grad():
        lp_s, _, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, mask, C)
        for _ in range(2):
            lp_o, _, _ = ours._get_per_token_logps_and_entropies(ours.model, ids, mask, C)
    assert torch.equal(lp_o, lp_s)
    lines = [r.getMessage() for r in caplog.records if r.name == "trainers.rloo"]
    assert len(lines) == 1 and "final_logit_softcapping" in lines[0], lines


def _train_logs(cls, tok, tmp_path, model, **config):
    # steps_per_generation=4 > accumulation=2: step 2 trains off-policy on the buffered half of
    # step 1's generation (ratios ≠ 1); step 3 generates again from the updated adapter.
    args = _config(tmp_path, max_steps=3, gradient_accumulation_steps=2, steps_per_generation=4,
                   per_device_train_batch_size=2, num_generations=4, learning_rate=5e-3,
                   **config)
    tr = cls(model=copy.deepcopy(model), reward_funcs=[_reward_chars, _reward_digits],
             args=args, train_dataset=_dataset(), processing_class=tok)
    randomize_adapter(tr.model, seed=3)  # the policy moves away from its "ref" adapter copy
    torch.manual_seed(0)  # generation samples from the global RNG: same stream for both runs
    with fused_if_ours(tr):
        tr.train()
    return [h for h in tr.state.log_history if "loss" in h]


def test_train_logs_match_trl(tok, tmp_path):
    # Untied: the tied tiny model is so peaky that all samples coincide and the loss is 0.
    model = tiny_model(tok, tied=False)
    cfg = dict(beta=0.05, normalize_advantages=True, reward_clip_range=(0.0, 8.0),
               epsilon_high=0.28)
    logs_s = _train_logs(trl.RLOOTrainer, tok, tmp_path / "s", model, **cfg)
    logs_o = _train_logs(RLOOTrainer, tok, tmp_path / "o", model, **cfg)
    assert logs_s[0]["loss"] != 0 and logs_s[0]["kl"] != 0  # a real learning signal
    for s, o in zip(logs_s, logs_o, strict=True):
        if "reward" in s:  # identical samples, else the comparison would be moot
            assert o["reward"] == s["reward"]
    # ours also times its generations (trainers.sampling.on_policy)
    assert_same_logs(logs_s, logs_o, steps=3, rel=1e-4, abs_=METRIC_ABS,
                     ours_only={"timing/generation_s"})
