"""trainers.SFTTrainer against stock trl.SFTTrainer 1.16 on tiny offline fp32 Llamas.

Covers: loss, gradients and the `entropy` / `mean_token_accuracy` / `num_tokens` metrics after
one `compute_loss` + backward on the same collated batch, for completion-only (prompt /
completion), assistant-only (conversational), padding-free and packed batches, with and without
`num_items_in_batch`, nll and dft losses, tied and untied embeddings, LoRA and full
fine-tuning; a 3-step `train()` with gradient accumulation whose logs match stock TRL step by
step; the fallback to TRL's compute_loss; and the errors for unsupported setups.

Every test of ours' loss runs it inside `_trainer_pairs.fused_head_ran`, so it fails if ours fell
back to TRL's code (check: `PYTHONPATH=tests python -m pytest -p _force_fallback ...`,
tests/_force_fallback.py). Under that mutation only the refusals and the version check pass:
they stop at construction.

    python -m pytest tests/test_trainers_sft.py -q

Tolerances. fp32 throughout (bf16=False), identical hidden states in both trainers, so only the
head's summation order differs. Loss and gradients are held to stock's own distance from the same
step on the fp64 model (×3, tests/_tolerance.py's `assert_grads_vs_fp64`), which follows the depth
and sum lengths of the backward on any machine; exact token counts and accuracies (argmax ties are
measure-zero in fp32 here). The tied tiny model is peaky (H ~ 2e-3): grpo_lce's entropy H = lse − Σ
p z is exact to a few ulp of max|z| (~20), so the entropy metric gets abs 2e-5 (see
tests/test_trainers_grpo.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import trl
from _tiny_models import lora_tiny_llama as _model
from _tolerance import assert_grads_vs_fp64, assert_loss_vs_fp64, in_fp64
from _trainer_pairs import fused_head_ran, fused_if_ours
from datasets import Dataset
from peft import LoraConfig

from trainers import SFTTrainer
from trainers.tiny import build_tokenizer

ENTROPY_ATOL = 2e-5


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _datasets():
    # Repeated characters make the tied model's argmax right now and then, so the accuracy
    # metric is not trivially 0.
    prompt_completion = Dataset.from_dict({
        "prompt": ["1+1=", "2*3=", "abc", "what is 7-2?", "aaaa", "xyz"] * 3,
        "completion": ["2", "66 66", "def ghi", "5, I think", "aaaa", "zzzz"] * 3,
    })
    conversational = Dataset.from_dict({"messages": [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4444"},
         {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6!"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ok?"},
         {"role": "assistant", "content": "ok ok"}],
    ] * 4})
    text = Dataset.from_dict(
        {"text": ["the quick brown fox", "jumps over", "the lazy dog aaaa bbbb 1111"] * 4}
    )
    return {"prompt_completion": prompt_completion, "conversational": conversational,
            "text": text}


_DATA_CONFIG = {
    "prompt_completion": ("prompt_completion", {}),  # completion_only_loss defaults to on
    "assistant_only": ("conversational", {"assistant_only_loss": True}),
    "padding_free": ("text", {"padding_free": True, "max_length": None}),
    "packed": ("text", {"packing": True, "max_length": 32}),  # bfd packing, padding-free
}


def _config(tmp_path, **overrides):
    kw = dict(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
        per_device_train_batch_size=3, logging_steps=1, save_strategy="no", seed=0,
    )
    kw.update(overrides)
    return trl.SFTConfig(**kw)


def _pair(tok, tmp_path, model, data, **config):
    dataset_key, data_config = _DATA_CONFIG[data]
    args = _config(tmp_path, **data_config, **config)
    out = []
    for cls in (trl.SFTTrainer, SFTTrainer):
        tr = cls(model=copy.deepcopy(model), args=args, train_dataset=_datasets()[dataset_key],
                 processing_class=tok)
        tr.model.train()
        tr.current_gradient_accumulation_steps = 1  # set by the training loop otherwise
        out.append(tr)
    return out


def _step(tr, batch, num_items_in_batch):
    tr.model.zero_grad(set_to_none=True)
    loss = tr.compute_loss(tr.model, dict(batch), num_items_in_batch=num_items_in_batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters()
             if p.grad is not None}
    return loss.detach(), grads, {k: list(v) for k, v in tr._metrics["train"].items()}


_CASES = [
    # data, tied, peft, num_items_in_batch, loss_type
    ("prompt_completion", True, True, None, "nll"),
    ("prompt_completion", False, False, 17, "nll"),
    ("assistant_only", True, True, 40, "nll"),
    ("assistant_only", False, True, None, "dft"),
    ("padding_free", False, True, None, "nll"),
    ("padding_free", True, False, None, "dft"),
    ("packed", True, True, 100, "nll"),
    ("packed", False, True, None, "nll"),
]


@pytest.mark.parametrize("data,tied,peft,num_items,loss_type", _CASES)
def test_loss_grads_and_metrics_match_trl(tok, tmp_path, data, tied, peft, num_items, loss_type):
    stock, ours = _pair(tok, tmp_path, _model(tok, tied=tied, peft=peft), data,
                        loss_type=loss_type)
    batch = next(iter(stock.get_train_dataloader()))
    labels = batch["labels"]
    assert (labels == -100).any() and (labels != -100).any()  # a real mask is being honoured
    if data in ("padding_free", "packed"):
        assert "position_ids" in batch and batch["input_ids"].shape[0] == 1
    n = None if num_items is None else torch.tensor(num_items)

    loss_s, g_s, m_s = _step(stock, batch, n)
    with fused_head_ran(ours):
        loss_o, g_o, m_o = _step(ours, batch, n)
    with in_fp64(stock.model):
        loss_r, g_r, _ = _step(stock, batch, n)

    # against stock on the fp64 model, within K_REORDERED of stock's own error; the loss sums
    # the label tokens' nll (each a few nats, ~ the loss) over their count or num_items
    assert_loss_vs_fp64(loss_o, loss_s, loss_r, n_terms=int((labels != -100).sum()))
    assert_grads_vs_fp64(g_o, g_s, g_r)
    if not peft:
        assert "lm_head.weight" in g_s or "model.embed_tokens.weight" in g_s
    assert m_o.keys() == m_s.keys() == {"entropy", "mean_token_accuracy", "num_tokens"}
    assert m_o["num_tokens"] == m_s["num_tokens"]
    assert m_o["mean_token_accuracy"] == pytest.approx(m_s["mean_token_accuracy"], abs=1e-7)
    assert m_o["entropy"] == pytest.approx(m_s["entropy"], rel=1e-5, abs=ENTROPY_ATOL)


def test_train_logs_match_trl(tok, tmp_path):
    # Accumulation 2: Trainer passes num_items_in_batch; 3 optimizer steps of LoRA updates.
    model = _model(tok, tied=True)
    logs = []
    for cls, sub in ((trl.SFTTrainer, "s"), (SFTTrainer, "o")):
        args = _config(tmp_path / sub, max_steps=3, gradient_accumulation_steps=2,
                       per_device_train_batch_size=2, learning_rate=1e-2)
        tr = cls(model=copy.deepcopy(model), args=args,
                 train_dataset=_datasets()["prompt_completion"], processing_class=tok)
        with fused_if_ours(tr):
            tr.train()
        logs.append([h for h in tr.state.log_history if "loss" in h])
    logs_s, logs_o = logs
    assert len(logs_s) == len(logs_o) == 3
    assert logs_s[0]["loss"] != logs_s[-1]["loss"]  # it trained
    for step, (s, o) in enumerate(zip(logs_s, logs_o, strict=True), start=1):
        assert o.keys() == s.keys()
        assert o["num_tokens"] == s["num_tokens"]
        assert o["mean_token_accuracy"] == pytest.approx(s["mean_token_accuracy"], abs=1e-7)
        assert o["entropy"] == pytest.approx(s["entropy"], rel=1e-5, abs=ENTROPY_ATOL), step
        for k in ("loss", "grad_norm"):
            assert o[k] == pytest.approx(s[k], rel=1e-4), (step, k, o[k], s[k])


def test_return_outputs_gives_logits(tok, tmp_path):
    _, ours = _pair(tok, tmp_path, _model(tok), "prompt_completion")
    batch = next(iter(ours.get_train_dataloader()))
    # the fused path's own return_outputs branch (TRL's warns the same)
    with torch.no_grad(), pytest.warns(FutureWarning, match="logits"), fused_head_ran(ours):
        loss, outputs = ours.compute_loss(ours.model, dict(batch), return_outputs=True)
    assert outputs.logits.shape == (*batch["input_ids"].shape, len(tok))
    assert torch.isfinite(loss)


# ---------------------------------------------------------------- fallbacks and errors

# TRL 1.16 deprecates compute_loss_func; this test uses it on purpose
@pytest.mark.filterwarnings("ignore:`compute_loss_func` is deprecated:FutureWarning")
def test_compute_loss_func_falls_back_to_trl(tok, tmp_path):
    calls = []

    def my_loss(outputs, labels, num_items_in_batch=None):
        calls.append(1)
        logits = outputs.logits[:, :-1].float()
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)

    args = _config(tmp_path)
    ds = _datasets()["prompt_completion"]
    ours = SFTTrainer(model=_model(tok), args=args, train_dataset=ds, processing_class=tok,
                      compute_loss_func=my_loss)
    batch = next(iter(ours.get_train_dataloader()))
    ours.compute_loss(ours.model, dict(batch))
    ours.compute_loss(ours.model, dict(batch))
    assert len(calls) == 2
    assert ours._lce_fallbacks_logged == {"compute_loss_func is set"}


def _construct(tok, tmp_path, model, peft_config=None):
    return SFTTrainer(model=model, args=_config(tmp_path), processing_class=tok,
                      train_dataset=_datasets()["prompt_completion"], peft_config=peft_config)


@pytest.mark.parametrize("peft_kwargs,match", [
    ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),  # TRL itself refuses this one
    ({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, "modules_to_save"),
])
def test_adapter_on_lm_head_is_refused(tok, tmp_path, peft_kwargs, match):
    with pytest.raises(ValueError, match=match):
        _construct(tok, tmp_path, _model(tok, tied=False, peft=False),
                   peft_config=LoraConfig(r=4, **peft_kwargs))


def test_unsupported_trl_version_is_refused(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(RuntimeError, match=r"trainers\.SFTTrainer supports trl>=1\.16,<1\.17"):
        _construct(tok, tmp_path, _model(tok, peft=False))
