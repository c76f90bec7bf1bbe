"""trainers.DistillationTrainer against stock trl.DistillationTrainer 1.16 on tiny offline models.

Covers: the loss, the gradients and the `entropy` metric after one `compute_loss` + backward on
the same micro-batch (TRL's on-policy batch layout: left-padded prompts, right-padded
completions, a tool mask), for forward KL, reverse KL and JSD at several β, temperatures,
`num_items_in_batch` or not, Llama and Qwen2 students and teachers (of another width), tied and
untied heads, LoRA (frozen head: the "basis" backward) and full fine-tuning (trainable head:
the recompute), and the "chunked" implementation; each also against an fp64 copy of the same
models, where ours must be at least as close as TRL; a 3-step `train()` with gradient
accumulation and on-policy generation whose logs match stock TRL step by step; packed backbone
passes (`packing=True`: a dense block-diagonal mask under sdpa on CPU) against TRL's padded
ones, student and teacher each seen running (1, T) packs of the valid tokens, one pack or one
per row, a row without completion tokens, `packing="auto"` staying padded on CPU with one note,
a mask with a hole staying padded; the fallbacks to TRL's loss (logit scale, softcap) and the
seam check; the refusals at construction.

Every test of ours runs it inside `_trainer_pairs.fused_head_ran` (the fallback tests excepted),
so it fails if ours fell back to TRL's code (check: `PYTHONPATH=tests python -m pytest -p
_force_fallback ...`, tests/_force_fallback.py). Under that mutation only the seam check, the
refusals and the version check pass: they stop at construction or run no loss.

    python -m pytest tests/test_trainers_distillation.py -q

Tolerances. fp32 throughout (bf16=False); both trainers run the same backbones on the same
batch, so their hidden states are identical and only the divergence's arithmetic differs (TRL
takes log-probs as z − lse at the scale of the max logit, and the entropy and forward KL as
differences of running sums; the tiny models' heads are softened so that this stays at fp32
rounding, see `_model`): the entropy metric rel 1e-5 + abs 1e-6 (measured ≤ 5e-7). Loss and
gradients are held to the same step on fp64 models (our trainer with grpo_lce.reference's
divergence): within 3× of TRL's own distance to it (tests/_tolerance.py), which follows the
depth and the sum lengths of the backward on any machine. Packed against padded and TRL: the
same weights, but the packed pass attends over fewer (masked, exactly 0) keys and a left-padded
row starts at another RoPE position (exact in exact arithmetic, ~1 ulp of the angle in fp32:
tests/test_packing.py), so the hidden states differ at fp32 rounding, ~1e-6: loss and gradients
against the fp64 step as above, entropy rel 1e-5 + abs 2e-5 (as
tests/test_fused_forward_packing.py).
A packing bug (a row attending to its neighbour, a shifted position) moves the loss by 1e-2 or
more.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
import trl
import trl.trainer.distillation_trainer as trl_distillation
from _tiny_models import soft_head_model
from _tolerance import assert_grads_vs_fp64, assert_loss_vs_fp64
from _trainer_pairs import BackboneCalls, fused_head_ran, fused_if_ours
from datasets import Dataset
from peft import LoraConfig

from grpo_lce.reference import divergence_ref
from trainers import DistillationTrainer
from trainers.base import FusedHeadMixin
from trainers.distillation import _seam_missing_reason
from trainers.tiny import build_tiny_llama, build_tiny_qwen2, build_tokenizer

_BUILD = {"llama": build_tiny_llama, "qwen2": build_tiny_qwen2}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


_model = soft_head_model  # the head scaled down 4×, so that the divergences do not saturate


def _teacher(tok, arch):
    return _model(tok, arch, tied=False, peft=False, hidden=96, seed=7)


def _prompts():
    return Dataset.from_dict({"prompt": ["1+1=", "2*3=", "abc", "what is 7-2?", "aaaa", "xyz"]})


def _config(tmp_path, **overrides):
    kw = {"output_dir": str(tmp_path), "report_to": "none", "use_cpu": True, "bf16": False,
          "per_device_train_batch_size": 3, "logging_steps": 1, "save_strategy": "no",
          "seed": 0, "max_completion_length": 8, "gradient_checkpointing": False}
    kw.update(overrides)
    return trl.DistillationConfig(**kw)


def _batch(tok, *, num_items=None, tool_mask=False, seed=0, empty_row=False):
    """A micro-batch as TRL's `_generate_and_score_completions` lays it out: prompts padded on
    the left, completions on the right (their mask ends at each completion's EOS); with
    `empty_row`, a fourth row whose completion is all padding."""
    g = torch.Generator().manual_seed(seed)
    B, P, K = 3 + empty_row, 6, 7
    completion_mask = [[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5] + [[0] * 7] * empty_row
    batch = {
        "prompt_ids": torch.randint(8, len(tok), (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(8, len(tok), (B, K), generator=g),
        "completion_mask": torch.tensor(completion_mask),
    }
    batch["prompt_mask"][1, :2] = 0
    batch["prompt_mask"][2, :4] = 0
    batch["prompt_ids"][batch["prompt_mask"] == 0] = tok.pad_token_id
    batch["completion_ids"][batch["completion_mask"] == 0] = tok.pad_token_id
    if tool_mask:  # tokens a tool wrote: in the input, out of the loss
        batch["tool_mask"] = torch.ones(B, K, dtype=torch.long)
        batch["tool_mask"][0, 2:5] = 0
    if num_items is not None:
        batch["num_items_in_batch"] = torch.tensor(float(num_items))
    return batch


def _loss_terms(batch) -> int:
    """The completion tokens whose divergences the loss sums."""
    keep = batch["completion_mask"] * batch.get("tool_mask", 1)
    return int(keep.sum())


def _step(tr, batch):
    tr.model.zero_grad(set_to_none=True)
    loss = tr.compute_loss(tr.model, dict(batch))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters()
             if p.grad is not None}
    return loss.detach(), grads, list(tr._metrics["train"]["entropy"])


class _Fp64Reference(DistillationTrainer):
    """Our trainer on float64 copies of the models, its divergence from grpo_lce.reference."""

    def _lce_divergence_loss(self, student, h_s, h_t, w_s, w_t, mask, beta,
                             num_items_in_batch=None, student_lm_head_bias=None,
                             teacher_lm_head_bias=None, temperature=1.0, **_):
        d, ent = divergence_ref(h_s, w_s, h_t, w_t, beta=beta, mask=mask,
                                student_bias=student_lm_head_bias,
                                teacher_bias=teacher_lm_head_bias, temperature=temperature)
        n = (mask != 0).sum()
        divisor = n.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return d.sum() / divisor, ent.sum(), n


_CASES = [
    # student, teacher, tied, peft, beta, temperature, num_items, tool_mask, method
    ("llama", "llama", True, True, 0.5, 1.0, None, False, "basis"),
    ("llama", "qwen2", False, True, 0.0, 0.7, 17, False, "basis"),
    ("qwen2", "qwen2", True, True, 1.0, 1.5, None, True, "basis"),
    ("qwen2", "llama", False, False, 0.1, 1.0, 40, False, "basis"),  # trainable head
    ("llama", "qwen2", True, False, 0.9, 0.9, None, False, "basis"),  # trainable tied head
    ("qwen2", "llama", False, True, 0.5, 1.0, None, False, "chunked"),
    ("llama", "llama", True, False, 0.0, 1.0, None, True, "chunked"),
]


@pytest.mark.parametrize("student,teacher,tied,peft,beta,tau,num_items,tool_mask,method", _CASES)
def test_loss_grads_and_entropy_match_trl(tok, tmp_path, student, teacher, tied, peft, beta, tau,
                                          num_items, tool_mask, method):
    s_model, t_model = _model(tok, student, tied=tied, peft=peft), _teacher(tok, teacher)
    args = _config(tmp_path, beta=beta, temperature=tau)
    batch = _batch(tok, num_items=num_items, tool_mask=tool_mask)
    trl_seam = trl_distillation._chunked_divergence_loss

    results = []
    for cls, dtype in ((trl.DistillationTrainer, torch.float32),
                       (DistillationTrainer, torch.float32), (_Fp64Reference, torch.float64)):
        tr = cls(model=copy.deepcopy(s_model).to(dtype),
                 teacher_model=copy.deepcopy(t_model).to(dtype), args=args,
                 train_dataset=_prompts(), processing_class=tok)
        if cls is DistillationTrainer:
            tr._lce_divergence_method = method  # grpo_lce.linear_divergence's `method`
        tr.model.train()
        # ours through grpo_lce; the fp64 reference's divergence is grpo_lce.reference's
        with fused_head_ran(tr) if cls is DistillationTrainer else contextlib.nullcontext():
            results.append(_step(tr, batch))
    (loss_s, g_s, ent_s), (loss_o, g_o, ent_o), (loss_r, g_r, _) = results
    # the seam is scoped to our call: TRL's module still holds its own function
    assert trl_distillation._chunked_divergence_loss is trl_seam

    assert loss_o.dtype == torch.float32
    assert ent_o == pytest.approx(ent_s, rel=1e-5, abs=1e-6)
    assert g_s.keys() == g_o.keys() == g_r.keys() and len(g_s) > 0
    if not peft:  # the head's own gradient (the embedding's, when tied)
        assert "lm_head.weight" in g_o or "model.embed_tokens.weight" in g_o
    # against the fp64 models: within K_REORDERED of TRL's own error (tests/_tolerance.py);
    # the loss sums the completion tokens' divergences
    assert_grads_vs_fp64(g_o, g_s, g_r, what="grad vs fp64 models")
    assert_loss_vs_fp64(loss_o, loss_s, loss_r, n_terms=_loss_terms(batch),
                        what="loss vs fp64 models")


@pytest.mark.parametrize("student,teacher,tied,beta,packing", [
    ("llama", "qwen2", True, 0.5, "auto"),  # padded on CPU
    ("llama", "llama", False, 1.0, True),  # packed backbone passes
    pytest.param("qwen2", "llama", False, 0.0, "auto", marks=pytest.mark.slow),
])
def test_train_logs_match_trl(tok, tmp_path, student, teacher, tied, beta, packing):
    # On-policy: each generation batch (2 × accumulation 2 prompts) is sampled by the student;
    # both trainers seed alike and their students agree to fp32 rounding, so they sample the
    # same completions. 3 optimizer steps of LoRA updates.
    s_model, t_model = _model(tok, student, tied=tied, peft=True), _teacher(tok, teacher)
    logs = []
    for cls, sub, kw in ((trl.DistillationTrainer, "s", {}),
                         (DistillationTrainer, "o", {"packing": packing})):
        args = _config(tmp_path / sub, max_steps=3, gradient_accumulation_steps=2,
                       per_device_train_batch_size=2, learning_rate=1e-2, beta=beta)
        tr = cls(model=copy.deepcopy(s_model), teacher_model=copy.deepcopy(t_model), args=args,
                 train_dataset=_prompts(), processing_class=tok, **kw)
        with fused_if_ours(tr):
            tr.train()
        logs.append([h for h in tr.state.log_history if "loss" in h])
    logs_s, logs_o = logs
    assert len(logs_s) == len(logs_o) == 3
    assert logs_s[0]["loss"] != logs_s[-1]["loss"]  # it trained
    for step, (s, o) in enumerate(zip(logs_s, logs_o, strict=True), start=1):
        # ours also times its generations (trainers.sampling.on_policy)
        assert o.keys() - {"timing/generation_s"} == s.keys()
        for k in ("num_tokens", "completions/mean_length", "completions/max_length"):
            assert o[k] == s[k], (step, k)
        assert o["entropy"] == pytest.approx(s["entropy"], rel=1e-5, abs=1e-6), step
        for k in ("loss", "grad_norm"):
            assert o[k] == pytest.approx(s[k], rel=1e-4), (step, k, o[k], s[k])


# ---------------------------------------------------------------- packing


@contextlib.contextmanager
def _backbone_calls(tr, teacher=True):
    """{"student": [...], "teacher": [...]}: the (batch, length) of each backbone call inside the
    block (`BackboneCalls`), the teacher's left out with `teacher=False`."""
    models = {"student": tr.model, "teacher": tr.teacher_model}
    if not teacher:
        del models["teacher"]
    with contextlib.ExitStack() as stack:
        yield {who: stack.enter_context(BackboneCalls(_backbone(m))).shapes
               for who, m in models.items()}


def _backbone(model):
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    return lm.base_model


@pytest.mark.parametrize("student,teacher,tied,peft,beta,max_packed,empty_row", [
    ("llama", "qwen2", True, True, 0.5, None, False),  # one pack
    ("qwen2", "llama", False, False, 0.0, 10, True),  # one pack a row; trainable head
])
def test_packed_matches_padded_and_trl(tok, tmp_path, student, teacher, tied, peft, beta,
                                       max_packed, empty_row):
    s_model, t_model = _model(tok, student, tied=tied, peft=peft), _teacher(tok, teacher)
    args = _config(tmp_path, beta=beta)
    batch = _batch(tok, tool_mask=True, empty_row=empty_row)
    valid = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    scored_rows = batch["completion_mask"].any(1)
    row_tokens = valid[scored_rows].sum(1).tolist()  # packed rows, in order

    results = []
    for cls, kw in ((trl.DistillationTrainer, {}), (DistillationTrainer, {"packing": False}),
                    (DistillationTrainer, {"packing": True, "max_packed_tokens": max_packed})):
        tr = cls(model=copy.deepcopy(s_model), teacher_model=copy.deepcopy(t_model), args=args,
                 train_dataset=_prompts(), processing_class=tok, **kw)
        tr.model.train()
        with _backbone_calls(tr) as shapes, fused_if_ours(tr):
            results.append(_step(tr, batch))
    (loss_s, g_s, ent_s), (loss_u, g_u, ent_u), (loss_p, g_p, ent_p) = results

    # the packed trainer ran every backbone on (1, T) packs of the valid tokens only
    packs = [(1, sum(row_tokens))] if max_packed is None else [(1, n) for n in row_tokens]
    assert shapes == {"student": packs, "teacher": packs}
    # the same step on fp64 models: packed against TRL and padded, within K_REORDERED of their
    # own errors (tests/_tolerance.py)
    ref = _Fp64Reference(model=copy.deepcopy(s_model).double(),
                         teacher_model=copy.deepcopy(t_model).double(), args=args,
                         train_dataset=_prompts(), processing_class=tok)
    ref.model.train()
    loss_r, g_r, _ = _step(ref, batch)
    for loss, grads, ent in ((loss_s, g_s, ent_s), (loss_u, g_u, ent_u)):
        assert_loss_vs_fp64(loss_p, loss, loss_r, n_terms=_loss_terms(batch))
        assert ent_p == pytest.approx(ent, rel=1e-5, abs=2e-5)
        assert_grads_vs_fp64(g_p, grads, g_r)


def test_what_stays_padded(tok, tmp_path, caplog):
    s_model, t_model = _model(tok, "llama", tied=True, peft=True), _teacher(tok, "llama")
    args = _config(tmp_path, beta=0.5)
    caplog.set_level(logging.WARNING, logger="trainers.distillation")
    tr = DistillationTrainer(model=s_model, teacher_model=t_model, args=args,
                             train_dataset=_prompts(), processing_class=tok)
    tr.model.train()
    assert tr.packing == "auto"
    L = 6 + 7
    with _backbone_calls(tr) as shapes, fused_head_ran(tr):
        for seed in (0, 1):  # "auto" under sdpa on CPU: padded, said once
            _step(tr, _batch(tok, seed=seed))
    assert shapes == {"student": [(3, L)] * 2, "teacher": [(3, L)] * 2}
    notes = [r.getMessage() for r in caplog.records if "packing" in r.getMessage()
             or "stay padded" in r.getMessage()]
    assert notes == ["grpo_lce: log-prob passes stay padded (sdpa on CPU has no packed kernel)."]

    tr.packing = True  # a hole in a row's mask: only the padded pass is exact
    caplog.clear()
    holed = _batch(tok)
    holed["prompt_mask"][0, 3] = 0
    with _backbone_calls(tr, teacher=False) as shapes, fused_head_ran(tr):
        _step(tr, holed)
    assert shapes == {"student": [(3, L)]}
    assert any("not one contiguous run" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="packing must be True, False or 'auto'"):
        DistillationTrainer(model=s_model, teacher_model=t_model, args=args,
                            train_dataset=_prompts(), processing_class=tok, packing="yes")


def test_auto_pack_plan_needs_padding_to_remove():
    # the student / teacher pack plan under a kind that packs: "auto" leaves a batch without
    # padding to the padded pass (None), packs one with a pad token; True packs both
    ids = torch.randint(5, 50, (3, 10), generator=torch.Generator().manual_seed(0))
    full = torch.ones_like(ids)
    padded = full.clone()
    padded[0, 0] = 0  # one left-pad token
    class Stub:  # the trainer's packing state and rule, with a kind that packs
        packing, max_packed_tokens = "auto", None
        _lce_pack_if_shorter = FusedHeadMixin._lce_pack_if_shorter

        def _lce_packing_for(self, model):
            return "varlen"

        def _lce_packing_note(self, message):
            pass

    trainer = Stub()

    def pack_lengths(mask):
        out = DistillationTrainer._lce_pack_plan(trainer, None, ids, mask, 4)
        return None if out is None else [p.input_ids.shape[1] for p in out[1].packs]

    assert pack_lengths(full) is None and pack_lengths(padded) == [29]
    trainer.packing = True
    assert pack_lengths(full) == [30] and pack_lengths(padded) == [29]


@pytest.mark.gpu
def test_bf16_packs_through_varlen_on_cuda(tok, tmp_path):
    """On CUDA in bf16, `packing="auto"` switches sdpa to PyTorch's varlen FlashAttention
    (trainers.attention) for both backbones: they run (1, T) packs, and the loss and LoRA
    gradients stay within bf16 noise of the padded run (the attention kernel differs, so the
    hidden states differ by bf16 roundings; exactness is checked in fp32 above)."""
    s_model = _model(tok, "llama", tied=True, peft=True, hidden=256).to("cuda", torch.bfloat16)
    t_model = _model(tok, "qwen2", tied=False, peft=False, hidden=128, seed=7).to(
        "cuda", torch.bfloat16)
    args = _config(tmp_path, beta=0.5, use_cpu=False, bf16=True)
    batch = {k: v.to("cuda") for k, v in _batch(tok, tool_mask=True, empty_row=True).items()}
    runs = {}
    for packing in (False, "auto"):
        tr = DistillationTrainer(model=copy.deepcopy(s_model), teacher_model=copy.deepcopy(t_model),
                                 args=args, train_dataset=_prompts(), processing_class=tok,
                                 packing=packing)
        tr.model.train()
        with _backbone_calls(tr) as shapes, tr.compute_loss_context_manager():
            runs[packing] = _step(tr, batch), shapes
    ((loss_u, g_u, _), shapes_u), ((loss_p, g_p, _), shapes_p) = runs[False], runs["auto"]
    assert all(s[0] == 4 for s in shapes_u["student"] + shapes_u["teacher"])
    assert shapes_p["student"] == shapes_p["teacher"] == [(1, 13 + 8 + 4)]  # row 3: no completion
    assert abs(loss_p.item() - loss_u.item()) <= 2e-2 * abs(loss_u.item()) + 1e-3
    assert g_u.keys() == g_p.keys() and len(g_u) > 0
    for name, g in g_u.items():
        rel = ((g_p[name].float() - g.float()).norm() / g.float().norm().clamp(min=1e-12)).item()
        assert rel <= 5e-2, f"grad {name}: relative difference {rel:.3e}"


# ---------------------------------------------------------------- fallbacks, seam, refusals


@pytest.mark.parametrize("who, attr, value, reason", [
    ("student", "logit_scale", 2.0, "the student's logits are scaled by 2.0"),
    ("teacher", "final_logit_softcapping", 30.0, "the teacher's logits are softcapped at 30.0"),
])
def test_logit_transforms_fall_back_to_trl(tok, tmp_path, who, attr, value, reason):
    s_model, t_model = _model(tok, "llama", tied=True, peft=True), _teacher(tok, "qwen2")
    setattr((s_model if who == "student" else t_model).config, attr, value)
    _assert_trl_loss_serves(tok, tmp_path, s_model, t_model, reason)


def _assert_trl_loss_serves(tok, tmp_path, s_model, t_model, reason: str):
    """Stock and ours on the same models: ours logs exactly `reason` over two steps and its
    first loss is stock's to the bit (TRL's own divergence loss ran)."""
    args = _config(tmp_path, beta=0.5)
    losses = []
    for cls in (trl.DistillationTrainer, DistillationTrainer):
        tr = cls(model=copy.deepcopy(s_model), teacher_model=copy.deepcopy(t_model), args=args,
                 train_dataset=_prompts(), processing_class=tok)
        tr.model.train()
        losses.append(_step(tr, _batch(tok))[0])
        _step(tr, _batch(tok, seed=1))
    assert tr._lce_fallbacks_logged == {reason}
    assert losses[1] == losses[0]  # TRL's own function ran


def test_float64_models_fall_back_to_trl(tok, tmp_path):
    """grpo_lce computes in fp32 / bf16 / fp16: float64 student and teacher go to TRL's own
    divergence loss, one logged line naming the dtype, instead of an error from inside the op."""
    s_model = _model(tok, "llama", tied=True, peft=True).double()
    _assert_trl_loss_serves(
        tok, tmp_path, s_model, _teacher(tok, "qwen2").double(),
        "the student's LM head is torch.float64; grpo_lce computes in float32, bfloat16 or "
        "float16")


def test_seam_check():
    assert _seam_missing_reason(trl.DistillationTrainer._compute_loss) is None

    def moved(self, unwrapped_student, inputs, num_items_in_batch):
        return None

    assert "no longer calls _chunked_divergence_loss" in _seam_missing_reason(moved)


def test_adapter_on_lm_head_is_refused(tok, tmp_path):
    model = _BUILD["llama"](tok, hidden_size=32, num_layers=1, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="modules_to_save"):
        DistillationTrainer(model=model, teacher_model=_teacher(tok, "llama"),
                            args=_config(tmp_path), train_dataset=_prompts(),
                            processing_class=tok,
                            peft_config=LoraConfig(r=4, target_modules=["q_proj"],
                                                   modules_to_save=["lm_head"]))


def test_unsupported_trl_version_is_refused(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(RuntimeError,
                       match=r"trainers\.DistillationTrainer supports trl>=1\.16,<1\.17"):
        DistillationTrainer(model=_model(tok, "llama", tied=True, peft=False),
                            teacher_model=_teacher(tok, "llama"), args=_config(tmp_path),
                            train_dataset=_prompts(), processing_class=tok)
