"""trainers.DPOTrainer against stock trl.DPOTrainer 1.16 on tiny offline fp32 Llama and Qwen2.

Covers: per-sequence and per-token log-probs of the policy and of the reference; the loss, the LoRA
gradients and every logged metric (rewards, logps, `logits/*` from mean_logits,
`mean_token_accuracy` from is_top1, entropy) after one `compute_loss` + backward for every
`loss_type` TRL 1.16 accepts, and for the reference as a "ref" adapter, a disabled adapter, a
separate `ref_model` and precomputed log-probs (`precompute_ref_log_probs`, computed by our head),
WPO (`use_weighting`), a weighted mixture of losses with LD-DPO, an f-divergence, gradient
checkpointing, full fine-tuning of a tied head, a head with a bias; a `ref_model` that accelerate
wrapped for mixed precision (bf16=True) inside TRL's `__init__`; `padding_free=True` switched off
by TRL as in stock; a 3-step `train()` whose logs match stock TRL step by step; the fallback for a
softcapped model, with one logged line; WPO with an "sft" loss refused at construction (stock TRL
raises at the first step).

Every test of ours runs it inside `_trainer_pairs.fused_head_ran` (the softcapped fallback
excepted), so it fails if ours fell back to TRL's code (check: `PYTHONPATH=tests python -m pytest
-p _force_fallback ...`, tests/_force_fallback.py). Under that mutation only the refusal of WPO
with an "sft" loss passes: it stops at construction.

    python -m pytest tests/test_trainers_dpo.py -q

Tolerances. fp32 (bf16=False), identical weights and batches, so the hidden states are bit-identical
and only the head differs (summation order of two fp32 heads). Loss and gradients: within 3× of
stock's own distance to the same step on the fp64 models (tests/_tolerance.py, `assert_same_step`),
which scales with the depth and the sum lengths of the backward on any machine; per-token log-probs
atol 5e-5 (tests/test_trainers_grpo.py: the 4σ rounding of an H = 64 logit) and per-sequence sums of
≤ 20 of them √20 × that, 2e-4; metrics rel 1e-5 with abs 2e-5 (the entropy: TRL's own fp32 entropy
is ~1e-5 off fp64 on the peaky tiny models). Training logs after 3 optimizer steps rel 1e-4: Adam's
first steps move each weight by ~lr whatever the gradient's size, so a 1e-6 difference in a gradient
near 0 can flip a sign-sensitive update; the logs still agree to ~1e-5 in practice. The
mixed-precision cases (bf16 autocast on CPU) compare our path with itself, not with TRL's bf16-tile
head.
"""

from __future__ import annotations

import logging

import pytest
import torch
import trl
from _tiny_models import add_head_bias, tiny_model
from _trainer_pairs import (
    assert_close,
    assert_same_logs,
    assert_same_step,
    build_pair,
    build_trainer,
    fp64_step,
    fused_head_ran,
    loss_step,
    train_logs,
)
from datasets import Dataset
from peft import LoraConfig

from grpo_lce._dispatch import recording
from trainers import DPOTrainer
from trainers.tiny import build_tokenizer

LOGP_ATOL = 5e-5
SEQ_LOGP_ATOL = 2e-4  # a sum of <= 20 per-token errors, each <= LOGP_ATOL at 4σ: √20 × 5e-5
METRIC_REL, METRIC_ABS = 1e-5, 2e-5

# Every loss_type DPOTrainer 1.16 accepts (its error message lists them), with the options
# some need: exo_pair divides by the label smoothing, robust uses it.
LOSS_TYPES = [
    ("sigmoid", {}), ("hinge", {}), ("ipo", {}), ("exo_pair", {"label_smoothing": 1e-3}),
    ("nca_pair", {}), ("robust", {"label_smoothing": 0.1}), ("bco_pair", {}),
    ("sppo_hard", {}), ("aot", {}), ("aot_unpaired", {}), ("apo_zero", {}), ("apo_down", {}),
    ("discopop", {}), ("sft", {}), ("sigmoid_norm", {}),
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _dataset():
    # A fresh in-memory dataset per trainer: its fingerprint is random, so TRL's cache of
    # precomputed reference log-probs is never shared between the stock trainer and ours.
    return Dataset.from_dict({
        "prompt": ["1+1=", "2*3=", "abc", "what is 7-2?", "aaaa", "xyz", "hi", "0"],
        "chosen": ["2", "66 66", "def ghi", "5, I think", "aaaa", "zzzz", "hello", "000"],
        "rejected": ["3", "6", "xyz", "4, no", "ab", "zz zz zz", "bye!", "1"],
    })


def _config(tmp_path, **overrides):
    kw = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
              per_device_train_batch_size=4, logging_steps=1, save_strategy="no", seed=0,
              beta=0.5)
    kw.update(overrides)
    return trl.DPOConfig(**kw)


def _pair(tok, tmp_path, model, *, ref_model=None, peft_config=None, **config):
    """(stock, ours) in train mode (`build_pair`: copies of the models, the same random LoRA
    weights), each with its own config and dataset."""
    return build_pair(trl.DPOTrainer, DPOTrainer, model, lambda: dict(
        ref_model=ref_model, args=_config(tmp_path, **config), train_dataset=_dataset(),
        processing_class=tok, peft_config=peft_config))


def _batch(tr, n=4):
    """The collated batch of the first n examples of tr's own dataset (its precomputed
    reference log-probs included)."""
    return tr.data_collator([tr.train_dataset[i] for i in range(n)])


def _step(stock, ours, n=4, *, fused=True):
    """stock's and our fp32 steps (ours inside `fused_head_ran` unless `fused=False`), and
    stock's on the fp64 models (assert_same_step's truth)."""
    stock_step = loss_step(stock, _batch(stock, n))
    truth = fp64_step(stock, _batch(stock, n))
    if not fused:
        return stock_step, loss_step(ours, _batch(ours, n)), truth
    with fused_head_ran(ours):
        ours_step = loss_step(ours, _batch(ours, n))
    return stock_step, ours_step, truth


def _same(steps, **kw):
    assert_same_step(*steps, metric_rel=METRIC_REL, metric_abs=METRIC_ABS, **kw)


@pytest.mark.parametrize("loss_type,extra", LOSS_TYPES, ids=[lt for lt, _ in LOSS_TYPES])
def test_every_loss_type_matches_trl(tok, tmp_path, loss_type, extra):
    # The policy is a PeftModel, so TRL keeps its initial adapter as the "ref" adapter.
    stock, ours = _pair(tok, tmp_path, tiny_model(tok, tied=False), loss_type=loss_type, **extra)
    steps = _step(stock, ours)
    _same(steps)
    metrics = steps[0][2]
    assert metrics["rewards/margins"][0] != 0  # the policy really differs from its reference


def _ref_model(tok, arch="llama"):
    return tiny_model(tok, arch, tied=False, peft=False, seed=1)


_OPTION_CASES = {
    # name: (arch, tied, policy PEFT?, peft_config, ref_model?, config)
    "disabled_adapter": ("qwen2", True, False, True, False, {}),
    "ref_model": ("llama", False, True, False, True, {"loss_type": "ipo"}),
    "precompute_ref": ("qwen2", False, True, False, False, {"precompute_ref_log_probs": True}),
    "precompute_ref_model": ("llama", True, True, False, True,
                             {"precompute_ref_log_probs": True, "loss_type": "hinge"}),
    "wpo": ("qwen2", False, True, False, False, {"use_weighting": True}),
    "wpo_tied": ("llama", True, True, False, False,
                 {"use_weighting": True, "loss_type": "bco_pair"}),
    "mixture_ld": ("llama", False, True, False, False,
                   {"loss_type": ["sigmoid", "bco_pair", "sft"],
                    "loss_weights": [0.8, 0.2, 1.0], "ld_alpha": 0.5}),
    "js_divergence": ("qwen2", True, True, False, False,
                      {"f_divergence_type": "js_divergence", "loss_type": "sigmoid_norm"}),
    "checkpointing": ("qwen2", False, True, False, False, {"gradient_checkpointing": True}),
}


@pytest.mark.parametrize("case", list(_OPTION_CASES))
def test_reference_and_options_match_trl(tok, tmp_path, case):
    arch, tied, peft, use_peft_config, with_ref, config = _OPTION_CASES[case]
    model = tiny_model(tok, arch, tied=tied, peft=peft)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") \
        if use_peft_config else None
    ref_model = _ref_model(tok, "llama" if arch == "llama" else "qwen2") if with_ref else None
    if config.get("precompute_ref_log_probs"):
        with recording() as rec:
            stock, ours = _pair(tok, tmp_path, model, ref_model=ref_model,
                                peft_config=peft_config, **config)
        # only our precompute calls grpo_lce during construction (not a cache of stock's)
        assert rec.paths, "the reference log-probs were not precomputed by grpo_lce"
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            assert_close(torch.tensor(ours.train_dataset[key]),
                         torch.tensor(stock.train_dataset[key]), atol=SEQ_LOGP_ATOL,
                         what=f"precomputed {key}")
    else:
        stock, ours = _pair(tok, tmp_path, model, ref_model=ref_model, peft_config=peft_config,
                            **config)
    assert (stock.ref_model is None) == (ours.ref_model is None) == (not with_ref)
    _same(_step(stock, ours))


def test_full_finetune_and_head_bias(tok, tmp_path):
    # No PEFT: the tied head is trained (the embedding gets the head's gradient too).
    stock, ours = _pair(tok, tmp_path, tiny_model(tok, tied=True, peft=False),
                        ref_model=_ref_model(tok))
    steps = _step(stock, ours)
    _same(steps, lora_only=False)
    assert "model.embed_tokens.weight" in steps[0][1]
    # A frozen head with a bias under LoRA: the bias enters log-probs and mean_logits
    stock, ours = _pair(tok, tmp_path, add_head_bias(tiny_model(tok, tied=False)))
    _same(_step(stock, ours))


def test_per_token_logps_policy_and_reference_match_trl(tok, tmp_path):
    stock, ours = _pair(tok, tmp_path, tiny_model(tok, "qwen2", tied=False),
                        ref_model=_ref_model(tok, "qwen2"))
    batch = _batch(stock)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    kw = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
              labels=labels, fused_lm_head=True)
    with torch.no_grad():
        for which in ("model", "ref_model"):
            s = getattr(stock, which)(**kw)
            with fused_head_ran(ours):
                o = getattr(ours, which)(**kw)
            mask = batch["completion_mask"][:, 1:].bool()
            assert_close(o.log_probs, s.log_probs, atol=LOGP_ATOL, what=f"{which} log_probs")
            assert_close(o.log_probs.sum(1), s.log_probs.sum(1), atol=SEQ_LOGP_ATOL,
                         what=f"{which} per-sequence")
            assert (o.log_probs[~mask] == 0).all() and (o.log_probs[mask] != 0).all()
            if which == "model":
                assert torch.equal(o.is_top1, s.is_top1)
                assert_close(o.mean_logits, s.mean_logits, atol=LOGP_ATOL, what="mean_logits")


def test_padding_free_is_turned_off_as_in_trl(tok, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        stock, ours = _pair(tok, tmp_path, tiny_model(tok), padding_free=True)
    assert stock.padding_free is False and ours.padding_free is False
    warned = [r for r in caplog.records if "`padding_free=True` is temporarily unavailable"
              in r.getMessage()]
    assert len(warned) == 2  # TRL's own warning, once per trainer
    _same(_step(stock, ours))


def test_softcapped_model_falls_back_with_one_line(tok, tmp_path, caplog):
    model = tiny_model(tok, tied=False)
    model.get_base_model().config.final_logit_softcapping = 5.0
    stock, ours = _pair(tok, tmp_path, model)
    with caplog.at_level(logging.WARNING, logger="trainers.dpo"):
        steps = _step(stock, ours, fused=False)
        loss_step(ours, _batch(ours))
    assert torch.equal(steps[0][0], steps[1][0])  # TRL's head in both: bit-identical
    lines = [r.getMessage() for r in caplog.records if r.name == "trainers.dpo"]
    assert len(lines) == 1 and "final_logit_softcapping" in lines[0], lines


def _train_logs(cls, tok, tmp_path, model):
    args = _config(tmp_path, max_steps=3, gradient_accumulation_steps=2,
                   per_device_train_batch_size=2, learning_rate=5e-3)
    return train_logs(cls, model, args=args, train_dataset=_dataset(), processing_class=tok)


def test_train_logs_match_trl(tok, tmp_path):
    model = tiny_model(tok, tied=False)
    logs_s = _train_logs(trl.DPOTrainer, tok, tmp_path / "s", model)
    logs_o = _train_logs(DPOTrainer, tok, tmp_path / "o", model)
    assert logs_s[0]["loss"] != logs_s[-1]["loss"]  # it trained
    assert_same_logs(logs_s, logs_o, steps=3, rel=1e-4, abs_=METRIC_ABS)


def test_reference_model_under_mixed_precision(tok, tmp_path):
    # bf16=True: TRL's __init__ prepares ref_model, and accelerate wraps its (TRL-patched)
    # forward in autocast; ours must take that wrapper's place and enter the same autocast.
    from trainers import fused_forward
    from trainers.models import unwrap_model

    stock, ours = _pair(tok, tmp_path, tiny_model(tok, tied=False), ref_model=_ref_model(tok),
                        bf16=True)
    ref = unwrap_model(ours.ref_model)
    forward = ref.__dict__["forward"]
    assert forward.grpo_lce_fused and forward.trl_forward is not ref._original_forward
    batch = _batch(ours)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    kw = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    with torch.no_grad():
        with fused_head_ran(ours):
            out = ours.ref_model(**kw, labels=labels, fused_lm_head=True)
        direct = {}
        for amp in (False, True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                direct[amp] = fused_forward.fused_outputs(
                    ref, (), dict(kw), labels=labels, shift_labels=None,
                    num_items_in_batch=None, temperature=1.0, outputs=("log_probs",))
        s_logits = stock.ref_model(**kw).logits
        o_logits = ours.ref_model(**kw).logits
    assert_close(out.log_probs, direct[True].log_probs, atol=1e-6, what="ours = ours in autocast")
    assert (out.log_probs - direct[False].log_probs).abs().max() > 1e-3  # autocast mattered
    assert o_logits.dtype == torch.float32 and torch.equal(o_logits, s_logits)
    with fused_head_ran(ours):
        loss_step(ours, batch)  # and the whole loss runs


def test_full_finetune_mixed_precision_train_then_evaluate(tok, tmp_path):
    # train() prepares the policy, and accelerate wraps its forward (ours by then) for mixed
    # precision; evaluate() with precomputed reference log-probs installs ours again: no-op.
    from trainers.models import unwrap_model

    args = _config(tmp_path, bf16=True, max_steps=1, precompute_ref_log_probs=True,
                   per_device_eval_batch_size=4)
    tr = DPOTrainer(model=tiny_model(tok, tied=False, peft=False), ref_model=_ref_model(tok),
                    args=args, train_dataset=_dataset(), processing_class=tok)
    with fused_head_ran(tr):
        tr.train()
    policy = unwrap_model(tr.model)
    assert policy._original_forward.grpo_lce_fused  # ours, inside accelerate's wrapper
    with fused_head_ran(tr):
        metrics = tr.evaluate(eval_dataset=_dataset())  # precomputes its reference log-probs
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))


def test_weighting_with_sft_loss_is_refused(tok, tmp_path):
    # Stock TRL 1.16 accepts the combination and raises inside its loss at the first step (the
    # SFT term, a scalar expanded to the batch, is scaled by the WPO weights in place). While it
    # does, ours refuses it at construction, naming both options.
    model = tiny_model(tok, tied=False)
    bad = dict(use_weighting=True, loss_type=["sigmoid", "sft"])
    stock = build_trainer(trl.DPOTrainer, model, args=_config(tmp_path, **bad),
                          train_dataset=_dataset(), processing_class=tok)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        loss_step(stock, _batch(stock))
    refusal = r"use_weighting=True with loss_type=.*'sft'.*use_weighting=False.*drop 'sft'"
    for loss_type in (["sigmoid", "sft"], "sft"):
        args = _config(tmp_path, use_weighting=True, loss_type=loss_type)
        with pytest.raises(ValueError, match=refusal):
            DPOTrainer(model=model, args=args, train_dataset=_dataset(), processing_class=tok)
        with pytest.raises(ValueError, match=refusal):  # the config as trl's third positional
            DPOTrainer(model, None, args, train_dataset=_dataset(), processing_class=tok)
