"""trainers.fused_forward: our fused-LM-head forward against TRL 1.16's on tiny offline fp32
Llama and Qwen2 models, without a trainer around it.

Covers: every field of `FusedCausalLMOutput` (log_probs, entropy, mean_logits, is_top1,
log_sum_sq_probs, label_mask, loss) against TRL's forward on the same batch and against fp64
logits, with shifted labels and with `shift_labels`, with and without `num_items_in_batch`, tied
and untied heads, a head bias, τ ≠ 1, through PEFT; the LoRA gradients of the loss and of the
entropy; an all-masked micro-batch; calls without `fused_lm_head` (logits, generate) handed to
TRL's forward unchanged; the fallbacks (softcapping, MoE router logits, multimodal inputs) with
one logged line per reason; installing twice; a model outliving its trainer.

Every comparison runs ours inside `_trainer_pairs.fused_head_ran`, so it fails if ours fell back
to TRL's head (check: `PYTHONPATH=tests python -m pytest -p _force_fallback ...`,
tests/_force_fallback.py). Under that mutation the calls without `fused_lm_head` (TRL's forward
by design), `_fallback_reason`, install and the model outliving its trainer (whose gate is
gone with it) need no fused head and pass.

    python -m pytest tests/test_fused_forward.py -q

Tolerances. fp32 throughout; both forwards run the same backbone on the same weights, so the hidden
states are bit-identical and only the head differs: TRL's tiles of 32768 columns with an online
logsumexp, against grpo_lce's chunk loop, both accumulating in fp32 in different orders. That is a
few ulp of |z| ≤ ~30: atol 5e-5 on per-token values (observed ≤ 7e-6, nearly all of it TRL's
entropy, which is that far from fp64 itself), so the loss, their mean, within 5e-5 too; in the
three-way test, within 3× of TRL's own distance to its forward on the fp64 model
(tests/_tolerance.py). The LoRA gradients (of the loss and the entropy) 1e-5 × max|grad| (observed ≤
2e-6): grpo_lce's entropy form rounds to ulps of max|z| where TRL's rounds to ulps of H, so TRL's
own error is no noise floor for them. Three-way against fp64 logits: ours within 2× TRL's own fp32
error plus a 32-ulp-of-max|z| floor (the entropy H = lse − Σ p z of grpo_lce cancels to a few ulp of
max|z|, see tests/test_trainers_grpo.py). is_top1 and label_mask exactly.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import logging

import pytest
import torch
from _tiny_models import add_head_bias, tiny_model
from _tolerance import assert_loss_vs_fp64, in_fp64, max_err
from _trainer_pairs import fused_head_ran
from trl.trainer.utils import add_fused_lm_head

from trainers import fused_forward
from trainers.base import FusedHeadMixin
from trainers.tiny import build_tokenizer

ALL_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits")
VALUE_ATOL = 5e-5
GRAD_RTOL = 1e-5
B, L = 4, 13


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


class _Stock:
    def __init__(self, model, ref_model=None):
        self.model, self.ref_model = model, ref_model


class _Trainer(FusedHeadMixin, _Stock):
    """Stands in for a TRL trainer that patched its models with add_fused_lm_head."""

    _trl_name = "DPOTrainer"
    _trl_fallback = "TRL's own fused head"
    _lce_logger = logging.getLogger("test_fused_forward")


def _patched(model, **options):
    """A copy of `model` with TRL's fused head on its causal LM (as TRL's trainers add it)."""
    m = copy.deepcopy(model)
    add_fused_lm_head(m.get_base_model() if hasattr(m, "get_base_model") else m, **options)
    return m


def _pair(model, **options):
    """(TRL's, ours, our stand-in trainer): two copies of `model`, ours with our forward."""
    stock, ours = _patched(model, **options), _patched(model, **options)
    trainer = _Trainer(ours)
    fused_forward.install(trainer)
    return stock, ours, trainer


def _batch(tok, *, seed=0, model=None):
    """ids, attention_mask (right-padded, like DPO's collator), labels: −100 outside a ragged
    completion span, and in row 3 everywhere but one token. With `model`, every other label is
    replaced by the model's top-1 token there, so is_top1 is exercised both ways."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, len(tok), (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, -3:] = 0
    mask[2, -6:] = 0
    ids[mask == 0] = tok.pad_token_id
    completion = torch.zeros(B, L, dtype=torch.bool)
    for b, (start, end) in enumerate([(4, L), (6, L - 3), (2, L - 6), (L - 1, L)]):
        completion[b, start:end] = True
    labels = ids.masked_fill(~completion, -100)
    if model is not None:
        with torch.no_grad():
            top1 = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)  # (B, L)
        pick = completion & (torch.arange(L) % 2 == 0)
        labels[:, 1:] = torch.where(pick[:, 1:], top1[:, :-1], labels[:, 1:])
    return ids, mask, labels


def _fp64_fields(model, ids, mask, y, temperature):
    """The per-token fields from fp64 logits of the same backbone, at positions scoring y."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    with torch.no_grad():
        h = lm.base_model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        head = lm.get_output_embeddings()
        z = h.double() @ head.weight.double().t()
        if head.bias is not None:
            z = z + head.bias.double()
        z = z / temperature  # (B, L-1, V)
    logp_all = z.log_softmax(-1)
    valid = y != -100
    yc = y.clamp(min=0)[..., None]
    out = {
        "log_probs": logp_all.gather(-1, yc)[..., 0],
        "entropy": -(logp_all.exp() * logp_all).sum(-1),
        "log_sum_sq_probs": torch.logsumexp(2 * logp_all, -1),
        "mean_logits": z.mean(-1),
        "is_top1": z.argmax(-1) == y,
    }
    return {k: torch.where(valid, v, torch.zeros_like(v)) for k, v in out.items()}, z.abs().max()


def _close(ours, ref, *, atol=0.0, rtol=0.0, what=""):
    e = max_err(ours, ref)
    bound = atol + rtol * ref.double().abs().max().item()
    assert e <= bound, f"{what}: max err {e:.3e} > {bound:.3e}"


CASES = [  # arch, tied, head bias, temperature
    ("llama", True, False, 1.0),
    ("llama", False, True, 0.7),
    ("qwen2", True, False, 0.7),
    ("qwen2", False, False, 1.0),
]


@pytest.mark.parametrize("arch,tied,bias,temperature", CASES)
def test_fields_match_trl_and_fp64(tok, arch, tied, bias, temperature):
    model = tiny_model(tok, arch, tied=tied)
    if bias:
        add_head_bias(model)
    stock, ours, trainer = _pair(model, temperature=temperature, outputs=ALL_OUTPUTS)
    ids, mask, labels = _batch(tok, model=stock)
    res = {}
    for name, m in (("trl", stock), ("ours", ours)):
        m.zero_grad(set_to_none=True)
        with fused_head_ran(trainer) if m is ours else contextlib.nullcontext():
            out = m(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            # the entropy carries a gradient in TRL's output: check ours does too, identically
            (out.loss + 0.1 * out.entropy.sum()).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        res[name] = (out, grads)
    (s, g_s), (o, g_o) = res["trl"], res["ours"]
    y = labels[:, 1:]
    assert o.log_probs.shape == s.log_probs.shape == (B, L - 1)
    for k in FIELDS:
        _close(getattr(o, k), getattr(s, k), atol=VALUE_ATOL, what=k)
        assert (getattr(o, k)[y == -100] == 0).all(), k
    assert torch.equal(o.is_top1, s.is_top1) and o.is_top1.dtype == torch.bool
    assert o.is_top1.any() and not o.is_top1[y != -100].all()  # both ways: a real comparison
    assert torch.equal(o.label_mask, s.label_mask)
    assert o.aux_loss is None and s.aux_loss is None
    assert o.mean_logits.grad_fn is None and o.log_sum_sq_probs.grad_fn is None
    assert g_s.keys() == g_o.keys() and len(g_s) > 0 and all("lora_" in n for n in g_s)
    # the loss: against TRL's forward on the fp64 model, within K_REORDERED of TRL's own fp32
    # error (tests/_tolerance.py); it averages the label tokens' nll
    with torch.no_grad(), in_fp64(stock):
        r = stock(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert_loss_vs_fp64(o.loss, s.loss, r.loss, n_terms=int((y != -100).sum()))
    # The gradients carry the entropy's, which grpo_lce forms as lse − Σ p z: on the peaky tied
    # models that rounds to a few ulp of max|z| where TRL's −Σ p log p rounds to ulps of H (5×
    # its error against fp64 here), so TRL's own error is no noise floor for them: 1e-5 × max|g|
    for n in g_s:
        _close(g_o[n], g_s[n], rtol=GRAD_RTOL, atol=1e-10, what=f"grad {n}")

    ref, z_max = _fp64_fields(ours, ids, mask, y, temperature)
    floor = 32 * torch.finfo(torch.float32).eps * z_max.item()
    for k in FIELDS:
        e_o, e_s = max_err(getattr(o, k), ref[k]), max_err(getattr(s, k), ref[k])
        assert e_o <= 2 * e_s + floor, f"{k}: |ours - fp64| {e_o:.2e}, |trl - fp64| {e_s:.2e}"
    assert torch.equal(o.is_top1, ref["is_top1"])


def test_shift_labels_and_num_items(tok):
    stock, ours, trainer = _pair(tiny_model(tok, tied=False), outputs=("log_probs", "is_top1"))
    ids, mask, labels = _batch(tok, seed=1)
    shift = torch.cat([labels[:, 1:], torch.full((B, 1), -100)], 1)  # (B, L): already shifted
    for kw in ({"shift_labels": shift, "labels": labels}, {"labels": labels,
                                                          "num_items_in_batch": 7}):
        s = stock(input_ids=ids, attention_mask=mask, fused_lm_head=True, **kw)
        with fused_head_ran(trainer):
            o = ours(input_ids=ids, attention_mask=mask, fused_lm_head=True, **kw)
        assert o.log_probs.shape == s.log_probs.shape
        _close(o.log_probs, s.log_probs, atol=VALUE_ATOL, what="log_probs")
        # the loss: the label tokens' nll summed over their count (or num_items), each term
        # within VALUE_ATOL, so within VALUE_ATOL x count / divisor
        n_valid = int((o.label_mask).sum())
        divisor = kw.get("num_items_in_batch", n_valid)
        _close(o.loss, s.loss, atol=VALUE_ATOL * n_valid / divisor, what="loss")
        assert torch.equal(o.is_top1, s.is_top1) and torch.equal(o.label_mask, s.label_mask)
        assert o.entropy is None and o.mean_logits is None and o.log_sum_sq_probs is None


def test_all_masked_micro_batch_backpropagates(tok):
    stock, ours, trainer = _pair(tiny_model(tok), outputs=("log_probs", "entropy"))
    ids, mask, labels = _batch(tok)
    labels = torch.full_like(labels, -100)
    for m in (stock, ours):
        with fused_head_ran(trainer) if m is ours else contextlib.nullcontext():
            out = m(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        assert out.loss.item() == 0.0 and out.loss.requires_grad
        out.loss.backward()  # connected to the graph: no "does not require grad" error
        assert all((p.grad == 0).all() for p in m.parameters() if p.grad is not None)


def test_calls_without_fused_head_go_to_trl_unchanged(tok):
    stock, ours, _ = _pair(tiny_model(tok), outputs=("log_probs",))
    ids, mask, labels = _batch(tok)
    lm = ours.get_base_model()
    assert inspect.signature(lm.forward) == inspect.signature(stock.get_base_model().forward)
    with torch.no_grad():
        s = stock(input_ids=ids, attention_mask=mask, labels=labels)
        o = ours(input_ids=ids, attention_mask=mask, labels=labels)
        assert torch.equal(o.logits, s.logits) and torch.equal(o.loss, s.loss)
        gen = [m.generate(input_ids=ids[:1, :4], max_new_tokens=3, do_sample=False)
               for m in (stock, ours)]
    assert torch.equal(gen[0], gen[1])


def test_softcapping_falls_back_with_one_line(tok, caplog):
    model = tiny_model(tok, tied=False)
    model.get_base_model().config.final_logit_softcapping = 5.0
    stock, ours, trainer = _pair(model, outputs=("log_probs", "entropy"))
    ids, mask, labels = _batch(tok)
    with caplog.at_level(logging.WARNING, logger="test_fused_forward"), torch.no_grad():
        s = stock(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        for _ in range(2):
            o = ours(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert torch.equal(o.log_probs, s.log_probs) and torch.equal(o.entropy, s.entropy)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "final_logit_softcapping=5.0" in lines[0], lines
    assert "TRL's own fused head" in lines[0]


def test_moe_router_logits_fall_back(tok, caplog):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
    torch.manual_seed(0)
    stock, ours, _ = _pair(MixtralForCausalLM(config))
    ids, mask, labels = _batch(tok)
    with caplog.at_level(logging.WARNING, logger="test_fused_forward"), torch.no_grad():
        s = stock(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        o = ours(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert o.aux_loss is not None and torch.equal(o.aux_loss, s.aux_loss)
    assert torch.equal(o.loss, s.loss)
    assert [r.getMessage() for r in caplog.records] == [
        "grpo_lce head not used (MoE router logits requested (TRL computes the load-balancing "
        "aux loss)); using TRL's own fused head."]


def test_multimodal_inputs_are_a_fallback_reason(tok):
    lm = tiny_model(tok, peft=False)
    reason = fused_forward._fallback_reason(lm, torch.zeros(1), None,
                                            {"pixel_values": torch.zeros(1), "image_sizes": None})
    assert reason == "multimodal inputs (pixel_values)"
    assert fused_forward._fallback_reason(lm, None, None, {}) == (
        "fused_lm_head=True without labels")
    assert fused_forward._fallback_reason(lm, torch.zeros(1), None, {}) is None


def test_install_is_idempotent_and_needs_trl_patch(tok):
    model = tiny_model(tok, peft=False)
    _, ours, trainer = _pair(model)
    ours_forward = ours.__dict__["forward"]
    fused_forward.install(trainer)
    assert ours.__dict__["forward"] is ours_forward
    assert fused_forward.trl_fused_forward(ours) is None  # ours now, TRL's kept inside it
    assert ours_forward.__func__.trl_forward.__func__.__code__.co_name == "_fused_forward"
    with pytest.raises(RuntimeError, match="TRL did not put its fused LM head on model"):
        fused_forward.install(_Trainer(copy.deepcopy(model)))


def test_model_outliving_its_trainer(tok, caplog):
    model = tiny_model(tok, tied=False)
    model.get_base_model().config.final_logit_softcapping = 5.0
    _, ours, trainer = _pair(model)
    del trainer
    gc.collect()
    ids, mask, labels = _batch(tok)
    with caplog.at_level(logging.WARNING, logger="trainers.fused_forward"), torch.no_grad():
        for _ in range(2):
            out = ours(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert out.log_probs.shape == (B, L - 1)
    assert len([r for r in caplog.records if "softcapping" in r.getMessage()]) == 1
