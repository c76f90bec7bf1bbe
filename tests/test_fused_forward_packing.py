"""Packing in trainers.fused_forward: padding-free backbone passes for the DPO / KTO / RLOO
fused forward, against the padded pass, on tiny offline fp32 Llama and Qwen2 models.

Covers: `trainers.packing.plan_target_packs` (the index maps for any shifted labels: right-
padded DPO / KTO rows, left- and right-padded RLOO rows, rows without a label left out, budgets
that split the batch; the masks and labels it refuses); every `FusedCausalLMOutput` field and
the LoRA gradients, packed (`packing=True`: a dense block-diagonal mask under sdpa on CPU) vs
padded, through our forward; DPO and KTO `compute_loss` + backward packed vs padded vs stock
TRL (loss, LoRA gradients, metrics), with the backbone seen running one (1, T) pack; RLOO's
left-padded log-probs; `packing="auto"` staying padded on CPU with one note, and the inputs
that keep a call padded.

Every pass of ours runs inside `_trainer_pairs.fused_head_ran`, so a comparison fails if ours
fell back to TRL's head (check: `PYTHONPATH=tests python -m pytest -p _force_fallback ...`,
tests/_force_fallback.py); the plan's and the options' checks run no head and pass under it.

    python -m pytest tests/test_fused_forward_packing.py -q

Tolerances. Same weights, and right-padded rows start at position 0 in both passes, so only the
attention's summation over a different number of (masked, exactly 0) keys and the GEMMs' row counts
differ: fp32 rounding, ~1e-6 on hidden states. Left-padded rows (RLOO) also start at another RoPE
position (exact in exact arithmetic, ~1 ulp of the angle in fp32: see tests/test_packing.py).
Observed ≤ 1.2e-6 on every per-token field, ≤ 1.4e-7 relative on the loss, ≤ 1.2e-6 × max|grad| on
gradients; so atol 5e-5 on per-token values; the loss and gradients within 3× of the padded
pass's own distance to the same step on the fp64 model (tests/_tolerance.py): the whole backbone's
backward differs in rounding, not just the head's, and that bound follows it on any machine. A
packing bug (a row attending to its neighbour, a shifted label)
moves log-probs by 1e-2 or more.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import trl
from _tiny_models import tiny_model
from _tolerance import assert_grads_vs_fp64, assert_loss_vs_fp64
from _trainer_pairs import (
    BackboneCalls,
    assert_close,
    assert_same_step,
    fp64_step,
    fused_head_ran,
    fused_if_ours,
    loss_step,
    randomize_adapter,
    trl_head_in_fp64,
)
from datasets import Dataset
from trl.trainer.utils import add_fused_lm_head

from trainers import DPOTrainer, KTOTrainer, RLOOTrainer
from trainers.base import FusedHeadMixin
from trainers.fused_forward import FusedForwardMixin
from trainers.packing import plan_target_packs, unpack
from trainers.tiny import build_tokenizer

VALUE_ATOL = 5e-5
METRIC_REL, METRIC_ABS = 1e-5, 2e-5
FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits")
ALL_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _lm(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# ---------------------------------------------------------------- the plan

def _right_padded(tok, B=4, L=12, seed=0):
    """DPO / KTO rows: prompt + completion from column 0, right-padded; labels on completions
    (the last row has none)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, len(tok), (B, L), generator=g)
    lens, prompts = [12, 9, 5, 7], [4, 2, 3, 7]
    mask = (torch.arange(L)[None] < torch.tensor(lens)[:, None]).long()
    ids[mask == 0] = tok.pad_token_id
    completion = (torch.arange(L)[None] >= torch.tensor(prompts)[:, None]) & mask.bool()
    labels = ids.masked_fill(~completion, -100)
    return ids, mask, labels


def _shifted(labels):
    return torch.cat([labels[:, 1:], torch.full((labels.shape[0], 1), -100)], 1)


def test_plan_target_packs_index_maps(tok):
    ids, mask, labels = _right_padded(tok)
    y = _shifted(labels)
    B, L = ids.shape
    for max_tokens in (B * L, 10):
        plan = plan_target_packs(ids, mask, y, max_tokens=max_tokens)
        rows = [0, 1, 2]  # row 3 has no label: left out
        packed = torch.cat([p.input_ids[0] for p in plan.packs])
        assert torch.equal(packed, torch.cat([ids[b][mask[b].bool()] for b in rows]))
        assert [p.input_ids.shape[1] for p in plan.packs] == (
            [26] if max_tokens == B * L else [12, 9, 5])  # a row longer than the budget alone
        # every label once, in its (b, t) slot; the hidden state at its own pack position
        assert torch.equal(unpack(plan.targets, plan), y.clamp(min=0))
        assert plan.out_index.numel() == (y != -100).sum()
        nxt = torch.cat([p.input_ids[0, p.hidden_index + 1] for p in plan.packs])
        assert torch.equal(nxt, plan.targets)  # labels are the next input token here


def test_plan_target_packs_refuses(tok):
    ids, mask, labels = _right_padded(tok)
    y = _shifted(labels)
    bad = y.clone()
    bad[1, 10] = 5  # a label scored by a padding position
    assert plan_target_packs(ids, mask, bad, max_tokens=100) is None
    holes = mask.clone()
    holes[0, 6] = 0
    assert plan_target_packs(ids, holes, y, max_tokens=100) is None
    assert plan_target_packs(ids, mask, torch.full_like(y, -100), max_tokens=100).packs == []


# ---------------------------------------------------------------- the forward

class _Stock:
    def __init__(self, model, ref_model=None):
        self.model, self.ref_model = model, ref_model


class _Trainer(FusedForwardMixin, _Stock):
    _trl_name = "DPOTrainer"
    _lce_logger = logging.getLogger("test_fused_forward_packing")


def _patched(model, **options):
    m = copy.deepcopy(model)
    add_fused_lm_head(_lm(m), **options)
    return m


def _left_and_right_padded(tok, B=4, P=5, C=7, seed=1):
    """RLOO rows: left-padded prompts, right-padded completions; labels on the completions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, len(tok), (B, P + C), generator=g)
    mask = torch.ones(B, P + C, dtype=torch.long)
    mask[0, :2] = 0
    mask[1, -4:] = 0
    mask[2, -1:] = 0
    mask[3, :3] = 0
    ids[mask == 0] = tok.pad_token_id
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :P] = -100
    return ids, mask, labels


@pytest.mark.parametrize("layout,arch,max_tokens", [("right", "llama", None),
                                                    ("left_right", "qwen2", 10)])
def test_packed_fields_and_grads_match_padded(tok, layout, arch, max_tokens):
    model = _patched(tiny_model(tok, arch, tied=False), temperature=0.8, outputs=ALL_OUTPUTS)
    tr = _Trainer(model, packing=True, max_packed_tokens=max_tokens)
    ids, mask, labels = (_right_padded if layout == "right" else _left_and_right_padded)(tok)
    res = {}
    for packing in (False, True):
        tr.packing = packing
        model.zero_grad(set_to_none=True)
        with BackboneCalls(_lm(model).base_model) as calls, fused_head_ran(tr):
            out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True,
                        use_cache=False)
            (out.loss + 0.1 * out.entropy.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        res[packing] = out, grads, calls.shapes
    (pad, g_pad, c_pad), (pack, g_pack, c_pack) = res[False], res[True]
    assert c_pad == [tuple(ids.shape)]
    assert len(c_pack) >= 1 and all(s[0] == 1 for s in c_pack)
    assert sum(s[1] for s in c_pack) == int(mask[(labels != -100).any(1)].sum())
    if max_tokens is not None:
        assert len(c_pack) > 1
    for k in FIELDS:
        assert_close(getattr(pack, k), getattr(pad, k), atol=VALUE_ATOL, what=k)
    assert torch.equal(pack.is_top1, pad.is_top1) and torch.equal(pack.label_mask,
                                                                    pad.label_mask)
    # loss and gradients: both against the padded forward on the fp64 model (TRL's head),
    # within K_REORDERED of the padded pass's own error (tests/_tolerance.py)
    assert tr.model is model
    model.zero_grad(set_to_none=True)
    with trl_head_in_fp64(tr):
        ref = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True,
                    use_cache=False)
        (ref.loss + 0.1 * ref.entropy.sum()).backward()
        g_r = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert_loss_vs_fp64(pack.loss, pad.loss, ref.loss.detach(),
                        n_terms=int((labels != -100).sum()))
    assert_grads_vs_fp64(g_pack, g_pad, g_r)


def test_what_stays_padded(tok, caplog):
    model = _patched(tiny_model(tok, peft=False))
    ids, mask, labels = _right_padded(tok)
    auto = _Trainer(model, packing="auto")
    with caplog.at_level(logging.WARNING, logger="test_fused_forward_packing"), \
            torch.no_grad(), BackboneCalls(model.base_model) as calls, fused_head_ran(auto):
        for _ in range(2):  # "auto" under sdpa on CPU: padded, said once
            model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        auto.packing = True
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels,
              fused_lm_head=True)
        holes = mask.clone()
        holes[0, 6] = 0
        model(input_ids=ids, attention_mask=holes, labels=labels, fused_lm_head=True)
        model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert calls.shapes[:4] == [tuple(ids.shape)] * 4
    assert calls.shapes[4][0] == 1  # the last call packed
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines
    assert "stay padded (sdpa on CPU has no packed kernel)" in lines[0]
    assert "packing off for forwards with position_ids" in lines[1]
    assert "dense (T, T) mask" in lines[2]  # packing=True under sdpa on CPU, said once
    assert "not one contiguous run" in lines[3]


@pytest.mark.slow  # FlexAttention on CPU compiles through inductor
def test_auto_packs_only_batches_with_padding_to_remove(tok):
    # FlexAttention packs under "auto" (CPU without grad): a batch with no padding and every
    # row scored runs padded (packing removes nothing); padding, or a row with no label, packs
    model = _patched(tiny_model(tok, peft=False))
    _lm(model).set_attn_implementation("flex_attention")
    tr = _Trainer(model, packing="auto")
    ids, mask, labels = _right_padded(tok)
    B, L = ids.shape
    full = torch.ones_like(mask)
    every_row = ids.masked_fill(torch.arange(L)[None] < 2, -100)  # labels past a 2-token prompt
    no_label = every_row.clone()
    no_label[1] = -100
    with torch.no_grad(), BackboneCalls(model.base_model) as calls, fused_head_ran(tr):
        for m, y in ((full, every_row), (mask, labels), (full, no_label)):
            model(input_ids=ids, attention_mask=m, labels=y, fused_lm_head=True)
    assert calls.shapes == [(B, L), (1, int(mask[(labels != -100).any(1)].sum())),
                            (1, (B - 1) * L)]


def test_packing_options_are_checked(tok):
    model = _patched(tiny_model(tok, peft=False))
    with pytest.raises(ValueError, match="packing must be True, False or 'auto'"):
        _Trainer(model, packing="sometimes")
    with pytest.raises(ValueError, match="max_packed_tokens must be a positive int"):
        _Trainer(model, max_packed_tokens=0)
    assert isinstance(_Trainer(model), FusedHeadMixin)


# ---------------------------------------------------------------- the trainers

def _dpo_data():
    return Dataset.from_dict({
        "prompt": ["1+1=", "2*3=", "abc", "what is 7-2?"], "chosen": ["2", "66 66", "d", "5!"],
        "rejected": ["3", "6", "xyz zy", "4, no"]})


def _kto_data():
    return Dataset.from_dict({
        "prompt": ["1+1=", "2*3=", "abc", "what is 7-2?"],
        "completion": ["2", "66 66", "def ghi", "5, I think"], "label": [True, False, True, False]})


_TRAINERS = {
    "dpo": (trl.DPOTrainer, DPOTrainer, trl.DPOConfig, _dpo_data, {"use_weighting": True}),
    "kto": (trl.KTOTrainer, KTOTrainer, trl.KTOConfig, _kto_data, {"desirable_weight": 1.2}),
}


@pytest.mark.parametrize("name", list(_TRAINERS))
def test_packed_trainer_matches_padded_and_trl(tok, tmp_path, name):
    stock_cls, ours_cls, config_cls, data, extra = _TRAINERS[name]
    model = tiny_model(tok, "qwen2", tied=False)
    args = config_cls(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                      per_device_train_batch_size=4, save_strategy="no", beta=0.5, **extra)
    trainers = {}
    for key, cls, kw in (("trl", stock_cls, {}), ("pad", ours_cls, {"packing": False}),
                         ("pack", ours_cls, {"packing": True})):
        tr = cls(model=copy.deepcopy(model), args=args, train_dataset=data(),
                 processing_class=tok, **kw)
        randomize_adapter(tr.model, seed=3)
        tr.model.train()
        trainers[key] = tr
    batch = trainers["trl"].data_collator([trainers["trl"].train_dataset[i] for i in range(4)])
    steps = {}
    for key, tr in trainers.items():
        with BackboneCalls(_lm(tr.model).base_model) as calls, fused_if_ours(tr):
            steps[key] = loss_step(tr, batch)
        steps[key, "calls"] = calls.shapes
    assert all(s[0] == 1 for s in steps["pack", "calls"])  # every pass packed...
    assert all(s[0] > 1 for s in steps["pad", "calls"])  # ... and none of these
    ref = fp64_step(trainers["trl"], batch)  # stock on the fp64 models: the truth for both
    tol = dict(metric_rel=METRIC_REL, metric_abs=METRIC_ABS)
    assert_same_step(steps["pad"], steps["pack"], ref, **tol)
    assert_same_step(steps["trl"], steps["pack"], ref, **tol)


def test_rloo_packed_logps_match_padded(tok, tmp_path):
    args = trl.RLOOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                          per_device_train_batch_size=4, num_generations=4, save_strategy="no",
                          temperature=0.7)
    tr = RLOOTrainer(model=tiny_model(tok, tied=True), args=args, processing_class=tok,
                     reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                     train_dataset=Dataset.from_dict({"prompt": ["a", "b"] * 4}), packing=True)
    ids, mask, _ = _left_and_right_padded(tok)
    out = {}
    for packing in (False, True):
        tr.packing = packing
        with torch.no_grad(), BackboneCalls(_lm(tr.model).base_model) as calls, \
                fused_head_ran(tr):
            out[packing] = tr._get_per_token_logps_and_entropies(
                tr.model, ids, mask, 7, batch_size=3, compute_entropy=True)
        out[packing, "calls"] = calls.shapes
    assert out[False, "calls"] == [(3, 12), (1, 12)] and out[True, "calls"] == [(1, 29), (1, 9)]
    for i, what in ((0, "logp"), (1, "entropy")):
        assert_close(out[True][i], out[False][i], atol=VALUE_ATOL, what=what)
