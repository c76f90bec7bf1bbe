"""Padding-free GRPO passes (`trainers.packing`): packed against padded on tiny fp32 Llamas.

Covers: the index maps of `plan_packs` / `unpack` (ragged rows, a 1-token completion, a row with
no completion, token budgets that split the batch, a row longer than the budget, masks that
cannot be packed); `packed_logprobs`, the one packed pass, against the same pass composed from
its parts and against padded; log-probs and entropies of the policy and the adapter-disabled reference,
loss and LoRA gradients (grpo and dapo, β > 0), packed vs padded in the same trainer; a short
`train()` whose logs match padded step by step; the varlen kwargs reaching the attention
function; flex_attention packing under "auto" (no-grad only: FlexAttention has no CPU
backward in torch 2.13); sdpa models switched to `trainers.attention` (the CUDA varlen kernel
replaced by its contract in plain sdpa; unpacked calls bit-identical to sdpa; the dense
fallback; refusals; its attention function registered on first use, not at import); and the
padded fallback, logged once, under sdpa on CPU.

    python -m pytest tests/test_packing.py -q

Tolerances. Both paths run the same fp32 weights, but packed rows start at position 0 while the
padded forward numbers a left-padded row from its pad count: RoPE makes that exact in exact
arithmetic, in fp32 the rotation angles (|θ| ≤ 17 rad here) round differently, ~1 ulp of the
angle per position, ~1e-6 on hidden states; the GEMMs also see different row counts, hence
different blockings and summation orders. Observed: max |Δ logp| 2e-6 at |logp| ≤ 18,
|Δ entropy| 1.4e-6, relative Δ loss ≤ 1e-6, Δ grad ≤ 1e-6 × max|grad|. Hence atol 2e-5 on
log-probs and entropies (≥ 10× margin); losses and gradients within 3× of the padded pass's own
distance to the same step on the fp64 model (tests/_tolerance.py), as in
tests/test_trainers_grpo.py; a packing bug (a row attending to its neighbour, an
off-by-one in the shift) moves log-probs by 1e-2 or more.
"""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from _ragged_batch import synthetic_ragged_batch
from _tolerance import assert_grads_vs_fp64, assert_loss_vs_fp64
from _trainer_pairs import trl_head_in_fp64
from peft import PromptTuningConfig, get_peft_model
from test_trainers_grpo import (
    _assert_close,
    _config,
    _dataset,
    _grads,
    _model,
    _reward_digits,
    _reward_len,
)
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from trl.trainer.utils import use_adapter

from trainers import GRPOTrainer, attention
from trainers.attention import choose_packing
from trainers.head import forward_hidden_states, head_logprobs, lm_head_params
from trainers.models import backbone, unwrap_causal_lm
from trainers.packing import packed_logprobs, plan_packs, plan_target_packs, unpack
from trainers.tiny import build_tiny_llama, build_tokenizer

LOGP_ATOL = 2e-5

# Rows of very different lengths: full prompt + full completion (17 tokens, longer than the
# 16-token budget below), a 1-token completion (EOS at once) after a 2-token prompt, a 1-token
# prompt, a truncated row with no completion token left, and two mid-sized rows.
B, P, C = 6, 7, 10
PROMPT_LENS = [7, 2, 5, 1, 7, 4]
COMPLETION_LENS = [10, 1, 6, 3, 0, 9]
N_PACKED = sum(p + c for p, c in zip(PROMPT_LENS, COMPLETION_LENS, strict=True) if c > 0)  # 48
# Greedy packs of the valid rows (17, 3, 11, 4, 13 tokens) under a 16-token budget: the 17-token
# row alone (over budget), 3 + 11, then 4, then 13 (4 + 13 > 16).
PACKS_AT_16 = [17, 14, 4, 13]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _ragged(tok):
    """ids, mask (B, P + C): prompts left-padded, completions ending in EOS right-padded."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(8, len(tok), (B, P + C), generator=g)
    mask = torch.zeros(B, P + C, dtype=torch.long)
    for b, (p, c) in enumerate(zip(PROMPT_LENS, COMPLETION_LENS, strict=True)):
        mask[b, P - p:P + c] = 1
        if 0 < c < C:
            ids[b, P + c - 1] = tok.eos_token_id
    ids[mask == 0] = tok.pad_token_id
    return ids, mask


def _trainer(tok, tmp_path, *, packing=True, tied=False, **config):
    tr = GRPOTrainer(
        model=_model(tok, tied=tied), reward_funcs=[_reward_len, _reward_digits],
        args=_config(tmp_path, per_device_train_batch_size=B, num_generations=B,
                     max_completion_length=C, **config),
        train_dataset=_dataset(), processing_class=tok, packing=packing,
    )
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
    return tr


class _BackboneCalls:
    """Records the (batch, length) of every log-prob pass's backbone call (generation's, which
    use the cache, are not recorded): (1, Σ n_b) when packed, (rows, L) when padded."""

    def __init__(self, model):
        self.shapes = []
        self._module = backbone(model)

    def __enter__(self):
        def hook(_m, args, kwargs):
            if kwargs.get("use_cache") is False:
                ids = kwargs.get("input_ids", args[0] if args else None)
                self.shapes.append(tuple(ids.shape))

        self._handle = self._module.register_forward_pre_hook(hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self._handle.remove()


# ---------------------------------------------------------------- index maps


def test_plan_packs_index_maps(tok):
    ids, mask = _ragged(tok)
    L = P + C
    for max_tokens in (B * L, 16):
        plan = plan_packs(ids, mask, C, max_tokens=max_tokens)
        rows = [b for b in range(B) if COMPLETION_LENS[b] > 0]  # the truncated row is left out
        packed = torch.cat([p.input_ids[0] for p in plan.packs])
        assert torch.equal(packed, torch.cat([ids[b][mask[b].bool()] for b in rows]))
        for pack in plan.packs:
            n = pack.cu_seqlens.diff()
            assert torch.equal(pack.position_ids[0], torch.cat([torch.arange(k) for k in n]))
            assert pack.max_seqlen == int(n.max())
        lens = [p.input_ids.shape[1] for p in plan.packs]
        assert lens == ([N_PACKED] if max_tokens == B * L else PACKS_AT_16)
        # every valid completion token, once, in its (b, k) slot, with its own id as target
        expected = ids[:, P:].masked_fill(mask[:, P:] == 0, 0).float()
        got = unpack(plan.targets.float(), plan)
        assert torch.equal(got, expected)
        assert plan.out_index.unique().numel() == plan.out_index.numel() == mask[:, P:].sum()
        # the hidden state at t − 1 scores the token at t, of the same row (position ≥ 1)
        after = torch.cat([p.input_ids[0, p.hidden_index + 1] for p in plan.packs])
        assert torch.equal(after, plan.targets)
        assert all((p.position_ids[0, p.hidden_index + 1] >= 1).all() for p in plan.packs)


def test_plan_packs_refuses_unpackable_masks(tok):
    ids, mask = _ragged(tok)
    holes = mask.clone()
    holes[0, P + 3] = 0  # a hole inside a completion
    assert plan_packs(ids, holes, C, max_tokens=10**6) is None
    no_prompt = mask.clone()
    no_prompt[3, :P] = 0  # an empty prompt: its first completion token has no predecessor
    assert plan_packs(ids, no_prompt, C, max_tokens=10**6) is None
    nothing = mask.clone()
    nothing[:, P:] = 0  # every completion truncated away: no packs, nothing to score
    assert plan_packs(ids, nothing, C, max_tokens=10**6).packs == []


def test_plan_if_shorter_leaves_unpadded_batches_padded(tok):
    # `if_shorter`: an empty plan (the padded pass) exactly when the packs would hold all B · L
    # tokens; any padding, or an unscored row, is something to remove
    ids, mask = _ragged(tok)
    full = torch.ones_like(mask)
    assert plan_packs(ids, full, C, max_tokens=10**6, if_shorter=True).packs == []
    assert len(plan_packs(ids, full, C, max_tokens=10**6).packs) == 1  # without: packs
    ragged = plan_packs(ids, mask, C, max_tokens=10**6, if_shorter=True)
    assert [p.input_ids.shape[1] for p in ragged.packs] == [N_PACKED]
    one_pad = full.clone()
    one_pad[1, 0] = 0  # one left-pad token
    lens = [p.input_ids.shape[1] for p in plan_packs(ids, one_pad, C, max_tokens=10**6,
                                                   if_shorter=True).packs]
    assert lens == [B * (P + C) - 1]
    targets = ids.clone()
    targets[2] = -100  # a full mask, but row 2 scores nothing: left out of the packs
    lens = [p.input_ids.shape[1] for p in plan_target_packs(ids, full, targets, max_tokens=10**6,
                                                          if_shorter=True).packs]
    assert lens == [(B - 1) * (P + C)]


def test_synthetic_ragged_batch_is_packable():
    ids, mask = synthetic_ragged_batch(8, 16, 64, 100, seed=3)
    fill = mask[:, 16:].float().mean().item()
    assert fill == pytest.approx(9 / 16, abs=0.01)  # (B + 1) / 2B at B = 8
    plan = plan_packs(ids, mask, 64, max_tokens=8 * 80)
    assert len(plan.packs) == 1 and plan.targets.numel() == mask[:, 16:].sum()


# ---------------------------------------------------------------- the packed pass


def _packed_by_hand(model, ids, mask, kind, max_tokens, **head_kwargs):
    """The packed pass from its parts: the plan, one forward per pack (in `packed_forward` for
    "sdpa_varlen"), one head call on the scored rows, unpack. What packed_logprobs must give."""
    weight, bias = lm_head_params(model)
    plan = plan_packs(ids, mask, C, max_tokens=max_tokens)
    hidden = []
    for pack in plan.packs:
        with attention.packed_forward() if kind == "sdpa_varlen" else nullcontext():
            h, _ = forward_hidden_states(model, **pack.model_inputs(kind))
        hidden.append(h[0, pack.hidden_index])
    out = head_logprobs(torch.cat(hidden), weight, bias, plan.targets, **head_kwargs)
    if head_kwargs.get("return_entropy"):
        return unpack(out[0], plan), unpack(out[1], plan)
    return unpack(out, plan), None


def test_packed_logprobs_is_the_packed_pass(tok, tmp_path):
    # The one entry point the trainer calls: the same (B, K) results as the pass composed by
    # hand (bit for bit: the same operations), within LOGP_ATOL of the padded pass, each model
    # call inside the given autocast; None for batches that stay padded.
    tr = _trainer(tok, tmp_path, temperature=0.7)
    lm = unwrap_causal_lm(tr.model)
    ids, mask = _ragged(tok)
    weight, bias = lm_head_params(tr.model)
    seen = []  # per backbone call: inside the autocast given? inside packed_forward?
    entered = []

    def autocast():
        entered.append(True)
        return nullcontext()

    handle = backbone(tr.model).register_forward_pre_hook(
        lambda *_: seen.append((len(entered), attention._packed.get())))
    cases = [("dense", B * (P + C), True), ("dense", 16, False), ("sdpa_varlen", 16, True)]
    with torch.no_grad():
        tr.packing = False
        lp_pad, ent_pad, _ = tr._get_per_token_logps_and_entropies(
            tr.model, ids, mask, C, compute_entropy=True)
        for kind, max_tokens, entropy in cases:
            if kind == "sdpa_varlen":
                attention.use_sdpa_varlen(lm)  # on CPU: the dense block-diagonal fallback
            kw = {"temperature": 0.7, "return_entropy": entropy}
            seen.clear()
            entered.clear()
            (lp, ent), note = packed_logprobs(
                tr.model, ids, mask, C, kind=kind, max_tokens=max_tokens, weight=weight,
                bias=bias, autocast=autocast, **kw)
            n_packs = 1 if max_tokens == B * (P + C) else len(PACKS_AT_16)
            assert note is None and seen == [(i + 1, kind == "sdpa_varlen")
                                             for i in range(n_packs)], (kind, seen)
            lp_hand, ent_hand = _packed_by_hand(tr.model, ids, mask, kind, max_tokens, **kw)
            assert torch.equal(lp, lp_hand), kind
            _assert_close(lp, lp_pad, atol=LOGP_ATOL, what=f"logp {kind} {max_tokens}")
            if entropy:
                assert torch.equal(ent, ent_hand), kind
                _assert_close(ent, ent_pad, atol=LOGP_ATOL, what=f"entropy {kind} {max_tokens}")
            else:
                assert ent is None and ent_hand is None
        holes, nothing = mask.clone(), mask.clone()
        holes[0, P + 3] = 0
        nothing[:, P:] = 0
        seen.clear()
        common = {"kind": "dense", "max_tokens": 10**6, "weight": weight, "bias": bias}
        packed, note = packed_logprobs(tr.model, ids, holes, C, **common)
        assert packed is None and "contiguous" in note
        assert packed_logprobs(tr.model, ids, nothing, C, **common) == (None, None)
        assert seen == []  # neither ran a forward: the caller's padded pass does
    handle.remove()


# ---------------------------------------------------------------- trainer parity


def _logps_both_ways(tr, ids, mask, **kw):
    out = {}
    for packing in (False, True):
        tr.packing = packing
        with _BackboneCalls(tr.model) as calls:
            out[packing] = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, C, **kw)
        out[packing, "calls"] = calls.shapes
    return out


def test_packed_logps_entropy_match_padded(tok, tmp_path):
    tr = _trainer(tok, tmp_path, temperature=0.7)
    ids, mask = _ragged(tok)
    for adapter in ("default", None):  # the policy, then the reference (adapter disabled)
        ctx = use_adapter(tr.model, adapter_name=None) if adapter is None else nullcontext()
        with ctx:
            out = _logps_both_ways(tr, ids, mask, batch_size=4, compute_entropy=True)
        (lp_pad, ent_pad, _), (lp_pack, ent_pack, _) = out[False], out[True]
        _assert_close(lp_pack, lp_pad, atol=LOGP_ATOL, what=f"logp adapter={adapter}")
        _assert_close(ent_pack, ent_pad, atol=LOGP_ATOL, what=f"entropy adapter={adapter}")
        assert (lp_pack[mask[:, P:] == 0] == 0).all() and (ent_pack[mask[:, P:] == 0] == 0).all()
        assert out[False, "calls"] == [(4, P + C), (2, P + C)]  # TRL's row chunks
        assert out[True, "calls"] == [(1, N_PACKED)]  # one pack: Σ n_b ≤ batch_size · L


_LOSS_CASES = [
    # loss_type, beta, importance_sampling_level, tied, max_packed_tokens (16: several packs,
    # the 17-token row alone in the first; the gradient flows back through each pack's forward)
    ("grpo", 0.04, "token", False, None),
    ("dapo", 0.04, "sequence", True, 16),
]


@pytest.mark.parametrize("loss_type,beta,level,tied,max_packed_tokens", _LOSS_CASES)
def test_packed_loss_and_lora_grads_match_padded(
    tok, tmp_path, loss_type, beta, level, tied, max_packed_tokens
):
    tr = _trainer(tok, tmp_path, tied=tied, loss_type=loss_type, beta=beta,
                  importance_sampling_level=level, temperature=0.9)
    tr.max_packed_tokens = max_packed_tokens
    ids, mask = _ragged(tok)
    g = torch.Generator().manual_seed(5)
    tr.packing = False
    with torch.no_grad():
        logps, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, C)
    inputs = {
        "prompt_ids": ids[:, :P], "prompt_mask": mask[:, :P],
        "completion_ids": ids[:, P:], "completion_mask": mask[:, P:],
        "advantages": torch.randn(B, generator=g),
        "num_items_in_batch": mask[:, P:].sum(),
        # old = current + noise (as after an optimizer step): ratios leave the clip range
        "old_per_token_logps": logps + 0.3 * torch.randn(B, C, generator=g),
        "ref_per_token_logps": logps + 0.5 * torch.randn(B, C, generator=g),
    }
    results = {}
    for packing in (False, True):
        tr.packing = packing
        tr.model.zero_grad(set_to_none=True)
        tr._metrics["train"].clear()
        with _BackboneCalls(tr.model) as calls:
            loss = tr.compute_loss(tr.model, inputs)
        loss.backward()
        metrics = {k: list(v) for k, v in tr._metrics["train"].items()}
        results[packing] = loss.detach(), _grads(tr.model), metrics, calls.shapes
    (loss_pad, g_pad, m_pad, c_pad), (loss_pack, g_pack, m_pack, c_pack) = (
        results[False], results[True])
    assert c_pad == [(B, P + C)]
    if max_packed_tokens is None:
        assert c_pack == [(1, N_PACKED)]
    else:
        assert c_pack == [(1, n) for n in PACKS_AT_16]
    # packed and padded: two fp32 orders through the backbone; both against the same step on
    # the fp64 model (TRL's head), within K_REORDERED of the padded pass's own error
    tr.model.zero_grad(set_to_none=True)
    with trl_head_in_fp64(tr):
        loss_r = tr.compute_loss(tr.model, inputs)
        loss_r.backward()
        g_r = _grads(tr.model)
    tr.model.zero_grad(set_to_none=True)
    assert_loss_vs_fp64(loss_pack, loss_pad, loss_r.detach(),
                        n_terms=int(inputs["completion_mask"].sum()),
                        term=inputs["advantages"].abs().max().item())
    assert all("lora_" in n for n in g_pad)
    assert_grads_vs_fp64(g_pack, g_pad, g_r)
    for k in m_pad:
        assert m_pack[k] == pytest.approx(m_pad[k], rel=1e-4, abs=2e-5), k


def test_packed_train_logs_match_padded(tok, tmp_path):
    # The real flow: generation, then the old-policy pass (steps_per_generation > accumulation)
    # and the reference pass (β > 0, adapter disabled) under no_grad, then the loss, all packed.
    logs = {}
    for packing in (False, True):
        args = _config(
            tmp_path / str(packing), max_steps=1, gradient_accumulation_steps=1,
            steps_per_generation=2, per_device_train_batch_size=2, num_generations=4,
            learning_rate=5e-3, beta=0.04, loss_type="dapo",
        )
        tr = GRPOTrainer(model=_model(tok, tied=False),
                         reward_funcs=[_reward_len, _reward_digits], args=args,
                         train_dataset=_dataset(), processing_class=tok, packing=packing)
        torch.manual_seed(0)  # generation samples from the global RNG: same stream for both
        with _BackboneCalls(tr.model) as calls:
            tr.train()
        logs[packing] = [h for h in tr.state.log_history if "loss" in h]
        logs[packing, "calls"] = calls.shapes
    # old-policy and reference passes over 4 rows in chunks of 2, then the loss pass over 2;
    # packed, each chunk's budget (2 · L tokens) holds 2 rows: as many calls, fewer tokens
    pad, packed = logs[False, "calls"], logs[True, "calls"]
    assert len(pad) == len(packed) == 5
    assert all(s[0] == 2 for s in pad) and all(s[0] == 1 for s in packed)
    assert sum(s[1] for s in packed) < sum(2 * s[1] for s in pad)
    assert len(logs[False]) == len(logs[True]) == 1 and logs[False][0]["loss"] != 0
    s, o = logs[False][0], logs[True][0]
    assert o.keys() == s.keys()
    for k in s.keys() - {"step_time"}:
        if k.startswith("timing/"):  # wall-clock seconds, not a result of the math
            continue
        assert o[k] == pytest.approx(s[k], rel=1e-4, abs=2e-5), (k, o[k], s[k])


# ---------------------------------------------------------------- attention implementations


def _varlen_reference_attention(module, query, key, value, attention_mask, scaling=None,
                                dropout=0.0, **kwargs):
    """What flash_attn_varlen_func computes, in plain sdpa: causal attention inside each
    [cu[i], cu[i+1]) segment of the packed sequence. Records the boundaries it was given."""
    assert attention_mask is None and query.shape[0] == 1
    cu = kwargs["cu_seq_lens_q"].tolist()
    _varlen_reference_attention.seen.append(cu)
    rep = query.shape[1] // key.shape[1]  # grouped-query attention
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    out = torch.cat([
        F.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scaling)
        for s, e in zip(cu[:-1], cu[1:], strict=True)
    ], dim=2)  # (1, heads, T, D)
    return out.transpose(1, 2).contiguous(), None


def test_varlen_kwargs_reach_attention(tok, tmp_path, monkeypatch):
    # A stand-in for flash_attention_2 (not installable on CPU): registered with transformers'
    # flash mask function, so "auto" packs it as "varlen" and passes cu_seq_lens explicitly.
    name = "grpo_lce_test_varlen"
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, name, _varlen_reference_attention)
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name, flash_attention_mask)
    monkeypatch.setattr(_varlen_reference_attention, "seen", [], raising=False)
    tr = _trainer(tok, tmp_path, packing="auto")
    ids, mask = _ragged(tok)
    config = unwrap_causal_lm(tr.model).config
    lp_pad, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, C)  # sdpa: padded
    config._attn_implementation = name  # set_attn_implementation would look for a hub kernel
    assert choose_packing(tr.model, "auto") == ("varlen", None)
    lp_pack, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, C)
    lens = [mask[b].sum().item() for b in range(B) if COMPLETION_LENS[b] > 0]
    boundaries = torch.tensor([0, *lens]).cumsum(0).tolist()
    assert _varlen_reference_attention.seen == [boundaries] * config.num_hidden_layers
    _assert_close(lp_pack, lp_pad, atol=LOGP_ATOL, what="logp varlen")


@pytest.mark.slow  # FlexAttention on CPU compiles through inductor
def test_flex_attention_packs_under_auto(tok, tmp_path):
    # FlexAttention runs on CPU without grad only (torch 2.13): the reference / old-policy pass.
    tr = _trainer(tok, tmp_path, packing="auto")
    ids, mask = _ragged(tok)
    with torch.no_grad():
        lp_pad, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, C)
        unwrap_causal_lm(tr.model).set_attn_implementation("flex_attention")
        assert choose_packing(tr.model, "auto") == ("block", None)
        with _BackboneCalls(tr.model) as calls:
            lp_pack, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, C)
    assert calls.shapes == [(1, N_PACKED)]
    _assert_close(lp_pack, lp_pad, atol=LOGP_ATOL, what="logp flex")
    # a batch without padding: "auto" runs it padded (nothing to remove), True packs it
    full = torch.ones_like(mask)
    with torch.no_grad():
        for packing, shapes in (("auto", [(B, P + C)]), (True, [(1, B * (P + C))])):
            tr.packing = packing
            with _BackboneCalls(tr.model) as calls:
                tr._get_per_token_logps_and_entropies(tr.model, ids, full, C)
            assert calls.shapes == shapes, packing


def test_dense_mask_attention_falls_back_to_padded_once(tok, tmp_path, caplog):
    tr = _trainer(tok, tmp_path, packing="auto")
    assert unwrap_causal_lm(tr.model).config._attn_implementation == "sdpa"
    ids, mask = _ragged(tok)
    with torch.no_grad():
        with caplog.at_level(logging.WARNING, logger="trainers.grpo"), \
                _BackboneCalls(tr.model) as calls:
            lp_auto, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, C)
            tr._get_per_token_logps_and_entropies(tr.model, ids, mask, C)
        tr.packing = False
        lp_off, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, C)
    assert calls.shapes == [(B, P + C)] * 2  # padded, twice
    assert torch.equal(lp_auto, lp_off)
    msgs = [r.getMessage() for r in caplog.records if "padded" in r.getMessage()]
    # one short line: what happens and why, and on CPU no suggestion (flex_attention, the one
    # alternative, fails in backward there)
    assert len(msgs) == 1 and "sdpa" in msgs[0] and "CPU" in msgs[0], msgs
    assert "\n" not in msgs[0] and len(msgs[0]) <= 100 and "flex" not in msgs[0], msgs


def test_packing_decided_once_per_model(tok, tmp_path, monkeypatch, caplog):
    # trainers.attention.choose_packing runs once per model, not once per pass; again when what
    # it reads changes (the option, the attention implementation). Sampling's settle call makes
    # the decision without logging its note; the first log-prob pass logs it, once.
    decided = []
    rule = attention.choose_packing
    monkeypatch.setattr(attention, "choose_packing",
                        lambda model, packing: decided.append(packing) or rule(model, packing))
    tr = _trainer(tok, tmp_path, packing="auto")
    ids, mask = _ragged(tok)

    def passes(n):
        with torch.no_grad(), _BackboneCalls(tr.model) as calls:
            for _ in range(n):
                tr._get_per_token_logps_and_entropies(tr.model, ids, mask, C)
        return calls.shapes

    with caplog.at_level(logging.WARNING, logger="trainers.grpo"):
        tr._lce_settle_attention(tr.model)
        assert decided == ["auto"] and caplog.records == []
        assert passes(3) == [(B, P + C)] * 3  # sdpa on CPU: padded
        assert decided == ["auto"]
        notes = [r.getMessage() for r in caplog.records]
        assert len(notes) == 1 and "stay padded" in notes[0], notes
        tr.packing = True
        assert passes(2) == [(1, N_PACKED)] * 2
        assert decided == ["auto", True]
        unwrap_causal_lm(tr.model).set_attn_implementation("eager")
        assert passes(2) == [(1, N_PACKED)] * 2
        assert decided == ["auto", True, True]


def test_unpackable_batch_and_options(tok, tmp_path, caplog):
    tr = _trainer(tok, tmp_path, packing=True)
    ids, mask = _ragged(tok)
    holes = mask.clone()
    holes[0, P + 3] = 0
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="trainers.grpo"):
        lp_forced, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, holes, C)
        tr.packing = False
        lp_off, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, holes, C)
    assert torch.equal(lp_forced, lp_off)  # fell back to the padded path
    msgs = [r.getMessage() for r in caplog.records]
    assert any("forced" in m for m in msgs) and any("contiguous" in m for m in msgs)
    with pytest.raises(ValueError, match="packing must be True, False or 'auto', got 'yes'"):
        GRPOTrainer(model=_model(tok), args=_config(tmp_path), packing="yes")
    with pytest.raises(ValueError, match="max_packed_tokens .* got 0"):
        GRPOTrainer(model=_model(tok), args=_config(tmp_path), max_packed_tokens=0)


def test_packing_blockers(tok):
    # Models that must never be packed, whatever the option: a prompt-learning adapter (its
    # virtual tokens would be prepended once per pack, not per row), non-attention layers (their
    # state would flow across rows), an attention function transformers cannot mask per row.
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1)
    model.set_attn_implementation("flex_attention")
    assert choose_packing(model, True) == ("block", None)
    assert choose_packing(model, False) == (None, None)
    prompt = get_peft_model(copy.deepcopy(model),
                            PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    kind, msg = choose_packing(prompt, True)
    assert kind is None and "prompt-learning" in msg
    model.config.layer_types = ["full_attention", "linear_attention"]
    kind, msg = choose_packing(model, True)
    assert kind is None and "linear_attention" in msg
    model.config.layer_types = None
    model.config._attn_implementation = "my_custom_attention"
    kind, msg = choose_packing(model, True)
    assert kind is None and "my_custom_attention" in msg


# ---------------------------------------------------------------- sdpa through varlen_attn

# In a fresh interpreter: importing every trainers module registers no attention function;
# the first switch to attention.IMPL does, whether asked for directly or made by "auto" packing
# (through GRPOTrainer._lce_packing_kind, or `_lce_settle_attention`, which fast generation
# calls before its first compile).
_REGISTRATION = r"""
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from trainers import GRPOTrainer, SFTTrainer, attention, generation, packing
from trainers.tiny import build_tiny_llama, build_tokenizer

def registered():
    return attention.IMPL in ALL_ATTENTION_FUNCTIONS, attention.IMPL in ALL_MASK_ATTENTION_FUNCTIONS

def bare_trainer():
    # GRPOTrainer's packing methods, with the state FusedHeadMixin.__init__ gives them (TRL's
    # __init__ would need a dataset and rewards)
    trainer = object.__new__(GRPOTrainer)
    trainer.packing = "auto"
    trainer._lce_packing_logged = set()
    trainer._lce_packing_decisions = attention.PackingDecisions()
    return trainer

assert registered() == (False, False), "importing trainers registered an attention function"
tok = build_tokenizer()
model = build_tiny_llama(tok, hidden_size=32, num_layers=1)
trainer = bare_trainer()
assert GRPOTrainer._lce_packing_kind(trainer, model, False) is None  # CPU fp32: padded
assert registered() == (False, False), "a padded choice registered an attention function"
attention.varlen_blocker = lambda lm: None  # what it says on CUDA in bf16
trainer = bare_trainer()  # a trainer on that machine (the decision above is kept per trainer)
assert GRPOTrainer._lce_packing_kind(trainer, model, False) == "sdpa_varlen"
assert registered() == (True, True) and model.config._attn_implementation == attention.IMPL
third = build_tiny_llama(tok, hidden_size=32, num_layers=1)
bare_trainer()._lce_settle_attention(third)  # what sampling calls first: the same switch
assert third.config._attn_implementation == attention.IMPL
other = build_tiny_llama(tok, hidden_size=32, num_layers=1)
attention.use_sdpa_varlen(other)  # registering again is harmless
assert other.config._attn_implementation == attention.IMPL
print("ok")
"""


@pytest.mark.slow  # a fresh interpreter
def test_sdpa_varlen_registers_on_first_use():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _REGISTRATION], cwd=root, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]



def _varlen_attn_reference(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=None,
                           is_causal=None, enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's contract in plain sdpa, (T, H, D) layout: causal
    attention inside each [cu[i], cu[i+1]) segment. Records what it was asked for."""
    assert window_size == (-1, 0) or is_causal is True  # causal, one way or the other
    assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    cu = cu_q.tolist()
    assert max_q == max_k == max(e - s for s, e in zip(cu[:-1], cu[1:], strict=True))
    _varlen_attn_reference.kv_heads.append(k.shape[1])
    if k.shape[1] != q.shape[1]:  # GQA: query head h reads kv head h // G, as FlashAttention
        if _varlen_attn_reference.refuses_gqa:
            raise RuntimeError("number of heads in key/value must equal the query's")
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    _varlen_attn_reference.seen.append(cu)
    out = torch.cat([
        F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
            is_causal=True, scale=scale).transpose(0, 1)
        for s, e in zip(cu[:-1], cu[1:], strict=True)
    ])  # (T, H, D)
    return out


@pytest.mark.parametrize("signature", ["window_size,enable_gqa", "window_size", "is_causal",
                                       "window_size,refuses_gqa"])
def test_sdpa_varlen_packs_sdpa_models(tok, tmp_path, monkeypatch, caplog, signature):
    # trainers.attention on CPU: the CUDA kernel is replaced by its contract in plain sdpa, for the
    # varlen_attn signatures torch has had (window_size + enable_gqa, window_size only, is_causal
    # only), and for one whose kernel refuses K and V with fewer heads than Q (then expanded).
    refuses = signature.endswith("refuses_gqa")
    params = frozenset({"scale", *signature.split(",")} - {"refuses_gqa"})
    monkeypatch.setattr(attention, "_varlen_attn", lambda: (_varlen_attn_reference, params))
    monkeypatch.setattr(attention, "_kernel_runs", lambda query: True)
    monkeypatch.setattr(attention, "_native_gqa", [True])
    monkeypatch.setattr(_varlen_attn_reference, "seen", [], raising=False)
    monkeypatch.setattr(_varlen_attn_reference, "kv_heads", [], raising=False)
    monkeypatch.setattr(_varlen_attn_reference, "refuses_gqa", refuses, raising=False)
    tr = _trainer(tok, tmp_path, packing="auto")
    lm = unwrap_causal_lm(tr.model)
    ids, mask = _ragged(tok)
    kw = dict(compute_entropy=True)
    lp_sdpa, ent_sdpa, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, C, **kw)
    assert lm.config._attn_implementation == "sdpa"  # CPU fp32: varlen_blocker said no
    attention.use_sdpa_varlen(lm)
    assert choose_packing(tr.model, "auto") == ("sdpa_varlen", None)
    tr.packing = False  # unpacked calls under IMPL are sdpa, bit for bit
    lp_off, ent_off, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, C, **kw)
    assert torch.equal(lp_off, lp_sdpa) and torch.equal(ent_off, ent_sdpa)
    assert _varlen_attn_reference.seen == []
    tr.packing = "auto"
    with _BackboneCalls(tr.model) as calls:
        lp, ent, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, C, **kw)
    assert calls.shapes == [(1, N_PACKED)]
    lens = [mask[b].sum().item() for b in range(B) if COMPLETION_LENS[b] > 0]
    boundaries = torch.tensor([0, *lens]).cumsum(0).tolist()
    assert _varlen_attn_reference.seen == [boundaries] * lm.config.num_hidden_layers
    # K and V keep their own heads (GQA in the kernel) unless the kernel refused them: one
    # refused call, one logged line, then every call expanded to the query heads
    n_layers, heads = lm.config.num_hidden_layers, lm.config.num_attention_heads
    kv = lm.config.num_key_value_heads
    assert kv < heads
    expected = [kv] + [heads] * n_layers if refuses else [kv] * n_layers
    assert _varlen_attn_reference.kv_heads == expected
    refusals = [r for r in caplog.records if "refused K and V" in r.getMessage()]
    assert len(refusals) == (1 if refuses else 0)
    _assert_close(lp, lp_sdpa, atol=LOGP_ATOL, what="logp sdpa_varlen")
    _assert_close(ent, ent_sdpa, atol=LOGP_ATOL, what="entropy sdpa_varlen")
    # gradients flow through the packed call (the reference runs under autograd here)
    (lp * mask[:, -C:]).sum().backward()
    packed_grads = _grads(tr.model)
    tr.model.zero_grad()
    tr.packing = False
    lp_pad, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, C)
    (lp_pad * mask[:, -C:]).sum().backward()
    padded_grads = _grads(tr.model)
    tr.model.zero_grad(set_to_none=True)
    with trl_head_in_fp64(tr):  # the same sum on the fp64 model: the truth for both
        lp_r, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, C)
        (lp_r * mask[:, -C:]).sum().backward()
        ref_grads = _grads(tr.model)
    tr.model.zero_grad(set_to_none=True)
    assert_grads_vs_fp64(packed_grads, padded_grads, ref_grads)


def test_sdpa_varlen_dense_fallback_and_refusals(tok, tmp_path, caplog):
    # Where the kernel cannot run (here: CPU fp32), a packed call under IMPL still keeps the
    # rows apart, with the block-diagonal mask; a packed call with a sliding window is refused.
    tr = _trainer(tok, tmp_path, packing=True)
    lm = unwrap_causal_lm(tr.model)
    ids, mask = _ragged(tok)
    with torch.no_grad():
        tr.packing = False
        lp_pad, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, C)
        attention.use_sdpa_varlen(lm)
        tr.packing = True
        with _BackboneCalls(tr.model) as calls:
            lp, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, mask, C)
    assert calls.shapes == [(1, N_PACKED)]
    _assert_close(lp, lp_pad, atol=LOGP_ATOL, what="logp sdpa_varlen dense fallback")
    reason = attention.varlen_blocker(build_tiny_llama(tok, hidden_size=32, num_layers=1))
    assert "CUDA" in reason or "varlen_attn" in reason
    q = torch.zeros(1, 2, 4, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="sliding_window"):
        attention.sdpa_varlen_attention(None, q, q, q, None, cu_seq_lens_q=cu, sliding_window=2)
