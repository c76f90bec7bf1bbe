"""trainers.KTOTrainer against stock trl.KTOTrainer 1.16 on tiny offline fp32 Llama and Qwen2.

Covers: the loss, LoRA gradients and every logged metric (kl, rewards, logps, `logits/*` from
mean_logits, entropy) after one `compute_loss` + backward, for both loss types ("kto", with its
KL pass, and "apo_zero_unpaired") × desirable / undesirable weights, with the reference as a
"ref" adapter, a disabled adapter, a separate `ref_model` and precomputed log-probs
(`precompute_ref_log_probs`, computed by our head, the KL completions' included); per-token
log-probs of the completion and KL passes; a 3-step `train()` whose logs match stock TRL step
by step; the fallback for a softcapped model, with one logged line.

Every comparison runs ours inside `_trainer_pairs.fused_head_ran`, so it fails if ours fell back
to TRL's code (check: `PYTHONPATH=tests python -m pytest -p _force_fallback ...`,
tests/_force_fallback.py).

    python -m pytest tests/test_trainers_kto.py -q

Tolerances: as in tests/test_trainers_dpo.py (fp32, bit-identical hidden states, two fp32 heads
summing in different orders): loss and gradients within 3× of stock's own distance to the fp64 step,
per-token log-probs atol 5e-5, per-sequence √20 × that, 2e-4, metrics rel 1e-5 / abs 2e-5, training
logs rel 1e-4.
"""

from __future__ import annotations

import logging

import pytest
import torch
import trl
from _tiny_models import tiny_model
from _trainer_pairs import (
    assert_close,
    assert_same_logs,
    assert_same_step,
    build_pair,
    fp64_step,
    fused_head_ran,
    loss_step,
    train_logs,
)
from datasets import Dataset
from peft import LoraConfig

from grpo_lce._dispatch import recording
from trainers import KTOTrainer
from trainers.tiny import build_tokenizer

LOGP_ATOL = 5e-5
SEQ_LOGP_ATOL = 2e-4  # a sum of <= 20 per-token errors, each <= LOGP_ATOL at 4σ: √20 × 5e-5
METRIC_REL, METRIC_ABS = 1e-5, 2e-5


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _dataset():
    # 5 desirable, 3 undesirable; a fresh in-memory dataset per trainer (random fingerprint:
    # TRL's cache of precomputed reference log-probs is never shared between the two trainers)
    return Dataset.from_dict({
        "prompt": ["1+1=", "2*3=", "abc", "what is 7-2?", "aaaa", "xyz", "hi", "0"],
        "completion": ["2", "66 66", "def ghi", "5, I think", "aaaa", "zz zz", "hello", "000"],
        "label": [True, False, True, True, False, True, False, True],
    })


def _config(tmp_path, **overrides):
    kw = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
              per_device_train_batch_size=4, logging_steps=1, save_strategy="no", seed=0,
              beta=0.5)
    kw.update(overrides)
    return trl.KTOConfig(**kw)


def _pair(tok, tmp_path, model, *, ref_model=None, peft_config=None, **config):
    """(stock, ours) in train mode (`build_pair`: copies of the models, the same random LoRA
    weights), each with its own config and dataset."""
    return build_pair(trl.KTOTrainer, KTOTrainer, model, lambda: dict(
        ref_model=ref_model, args=_config(tmp_path, **config), train_dataset=_dataset(),
        processing_class=tok, peft_config=peft_config))


def _batch(tr, start=0, n=4):
    return tr.data_collator([tr.train_dataset[i] for i in range(start, start + n)])


def _same(stock, ours, start=0, **kw):
    stock_step = loss_step(stock, _batch(stock, start))
    with fused_head_ran(ours):
        ours_step = loss_step(ours, _batch(ours, start))
    assert_same_step(stock_step, ours_step,
                     fp64_step(stock, _batch(stock, start)), metric_rel=METRIC_REL,
                     metric_abs=METRIC_ABS, **kw)


_CASES = {
    # name: (arch, tied, policy PEFT?, peft_config?, ref_model?, config)
    "kto_ref_adapter": ("llama", False, True, False, False, {}),
    "kto_weights": ("qwen2", True, True, False, False,
                    {"desirable_weight": 1.33, "undesirable_weight": 0.7}),
    "kto_disabled_adapter": ("llama", True, False, True, False, {"undesirable_weight": 1.5}),
    "kto_ref_model": ("qwen2", False, True, False, True, {"desirable_weight": 0.8}),
    "kto_precompute": ("llama", False, True, False, False,
                       {"precompute_ref_log_probs": True, "desirable_weight": 1.2}),
    "apo_zero_unpaired": ("qwen2", False, True, False, False,
                          {"loss_type": "apo_zero_unpaired", "undesirable_weight": 2.0}),
    "apo_precompute_ref_model": ("llama", True, True, False, True,
                                 {"loss_type": "apo_zero_unpaired",
                                  "precompute_ref_log_probs": True}),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_loss_grads_and_metrics_match_trl(tok, tmp_path, case):
    arch, tied, peft, use_peft_config, with_ref, config = _CASES[case]
    model = tiny_model(tok, arch, tied=tied, peft=peft)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") \
        if use_peft_config else None
    # the reference: the policy's own base weights, as a separate model
    ref_model = tiny_model(tok, arch, tied=tied, peft=False) if with_ref else None
    with recording() as rec:
        stock, ours = _pair(tok, tmp_path, model, ref_model=ref_model, peft_config=peft_config,
                            **config)
    if config.get("precompute_ref_log_probs"):
        # only our precompute calls grpo_lce during construction (not a cache of stock's)
        assert rec.paths, "the reference log-probs were not precomputed by grpo_lce"
        keys = ["ref_logps"] + (["ref_KL_logps"] if stock.calculate_KL else [])
        for key in keys:
            assert_close(torch.tensor(ours.train_dataset[key]),
                         torch.tensor(stock.train_dataset[key]), atol=SEQ_LOGP_ATOL,
                         what=f"precomputed {key}")
    for start in (0, 4):  # two batches: 3 desirable + 1, then 2 + 2
        _same(stock, ours, start)
    m = stock._metrics["train"]
    assert m["rewards/chosen"][0] != 0 and m["rewards/rejected"][0] != 0
    if stock.calculate_KL:
        assert max(m["kl"]) > 0  # the KL pass ran and the clamp at 0 did not hide it


def test_per_token_logps_completion_and_kl_passes_match_trl(tok, tmp_path):
    stock, ours = _pair(tok, tmp_path, tiny_model(tok, "qwen2", tied=True))
    batch = _batch(stock)
    with torch.no_grad():
        for prefix in ("", "KL_"):
            ids = batch[f"{prefix}input_ids"]
            labels = ids.masked_fill(batch[f"{prefix}completion_mask"] == 0, -100)
            kw = dict(input_ids=ids, attention_mask=batch[f"{prefix}attention_mask"],
                      labels=labels, fused_lm_head=True)
            s = stock.model(**kw)
            with fused_head_ran(ours):
                o = ours.model(**kw)
            assert_close(o.log_probs, s.log_probs, atol=LOGP_ATOL, what=f"{prefix}log_probs")
            assert_close(o.log_probs.sum(1), s.log_probs.sum(1), atol=SEQ_LOGP_ATOL,
                         what=f"{prefix}per-sequence")
            assert_close(o.mean_logits, s.mean_logits, atol=LOGP_ATOL, what="mean_logits")
            assert_close(o.entropy, s.entropy, atol=LOGP_ATOL, what="entropy")


def test_softcapped_model_falls_back_with_one_line(tok, tmp_path, caplog):
    model = tiny_model(tok, tied=False)
    model.get_base_model().config.final_logit_softcapping = 5.0
    stock, ours = _pair(tok, tmp_path, model)
    with caplog.at_level(logging.WARNING, logger="trainers.kto"):
        loss_s, _, _ = loss_step(stock, _batch(stock))
        loss_o, _, _ = loss_step(ours, _batch(ours))
    assert torch.equal(loss_o, loss_s)
    lines = [r.getMessage() for r in caplog.records if r.name == "trainers.kto"]
    assert len(lines) == 1 and "final_logit_softcapping" in lines[0], lines


def _train_logs(cls, tok, tmp_path, model):
    args = _config(tmp_path, max_steps=3, gradient_accumulation_steps=2,
                   per_device_train_batch_size=2, learning_rate=5e-3,
                   desirable_weight=1.2, undesirable_weight=0.9)
    return train_logs(cls, model, args=args, train_dataset=_dataset(), processing_class=tok)


def test_train_logs_match_trl(tok, tmp_path):
    model = tiny_model(tok, tied=False)
    logs_s = _train_logs(trl.KTOTrainer, tok, tmp_path / "s", model)
    logs_o = _train_logs(KTOTrainer, tok, tmp_path / "o", model)
    assert logs_s[0]["loss"] != logs_s[-1]["loss"]  # it trained
    assert_same_logs(logs_s, logs_o, steps=3, rel=1e-4, abs_=METRIC_ABS)
