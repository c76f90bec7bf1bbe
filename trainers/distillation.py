"""DistillationTrainer: TRL 1.16's DistillationTrainer with the divergence from `grpo_lce`.

    from trainers import DistillationTrainer   # instead of: from trl import DistillationTrainer

TRL 1.16 computes the loss in `DistillationTrainer._compute_loss`, which runs both backbones
(`_get_last_hidden_state`), finds both LM heads and their logit scales / softcaps, and hands it
all to one module-level function of trl/trainer/distillation_trainer.py:

    _chunked_divergence_loss(h_s, h_t, W_s, W_t, loss_mask, beta, num_items_in_batch, biases,
                             logit scales, softcaps, temperature) -> (loss, entropy_sum, n_valid)

No method takes the hidden states, and the function is looked up by name in the module's
globals. So `_compute_loss` is overridden by running TRL's own method, its code object
unchanged, as a function whose globals are a per-call copy of that module's globals with this
one name bound to `DistillationTrainer._lce_divergence_loss` (`_with_global`). Nothing is
assigned to TRL's module or classes: other trainers, other threads and TRL's own class keep
TRL's function, and nothing needs restoring. If a TRL release stops calling the function by
that name, the override says so once and runs TRL's method as it is.

What then replaces TRL's chunked kernel, per micro-batch:

    h_s (B, K, Hs), h_t (B, K, Ht)   both backbones at the K completion positions (TRL's)
    D, H = grpo_lce.linear_divergence(h_s, W_s, h_t, W_t, beta=β, temperature=τ,
                                      mask=loss_mask, biases, return_entropy=True)  (B, K) fp32
    loss = Σ D / num_items_in_batch   (TRL's count over the generated completions, per process)
           or Σ D / max(#valid, 1) without it
    entropy_sum = Σ H,  n_valid = #valid                  (TRL gathers and logs them)

TRL's definitions to the letter (β = 0 forward KL, β = 1 reverse KL, else the generalized JSD;
loss_mask = completion_mask × tool_mask), with both models' logits accumulated and kept in fp32
and never built as (B, K, V). Generation (on-policy, vLLM, tools), the teacher's forward, the
masks, the DDP / FSDP forward redirection, gradient accumulation, metrics and logging all stay
TRL's. The heads are read as `trainers.head` reads them: FSDP2 DTensors and ZeRO-3 partitioned
weights are gathered (`trainers.sharded`), the hidden states cast to the head's dtype, autocast
off for the head, so the GEMM dtype is the weights' (bf16 models: bf16 GEMMs, fp32 logits).

Packing (`packing=`, default "auto", and `max_packed_tokens=`: `trainers.base.
PackingOptionsMixin`). TRL runs both backbones on the padded (B, P + K) batch (prompts left-
padded, completions right-padded) and keeps the K completion positions. `_get_last_hidden_state`,
the one method TRL calls for the student's and for the teacher's pass, is overridden to run the
backbone on the valid tokens only, the rows one after another in packs of ≤ `max_packed_tokens`
(default: the padded call's B · (P + K)), position_ids restarting at 0 per row; the hidden
states that score a completion token are scattered back to TRL's (B, K, H), zeros at the
padding (which the loss mask drops). It is GRPO's plan (`trainers.packing.plan_packs`, with
TRL's `logits_to_keep` as K), and GRPO's rule for when "auto" packs (`trainers.attention`,
decided once for each model: the teacher may pack while the student does not); a left-padded
prompt's positions shift by its pad count, which RoPE turns into rounding only
(docs/DESIGN.md, "Packing"). Calls with multimodal inputs, and
batches whose mask is not one contiguous run per row, run TRL's padded pass (the latter with
one note).

Sampling: `_generate_single_turn` (TRL's regular generation path of the student's on-policy
completions) is served by our samplers, as in `trainers.GRPOTrainer`
(`trainers.sampling.on_policy`: options `fast_generation=True` and `sampler="auto"`, metrics
`timing/generation_s` and `fast_generation/*`); vLLM and multimodal prompts stay TRL's. The
loss uses the teacher's distribution, not sampling log-probs, so none are kept.

Falls back to TRL's own `_chunked_divergence_loss`, with one logged line per reason, when TRL
passes a logit scale ≠ 1 or a final-logit softcap for either model (Gemma 2/3, Cohere, Granite,
...), which grpo_lce does not apply, or a float64 head, which its ops do not take. Refused at
construction as for `trainers.GRPOTrainer` (`trainers.base`): TRL outside 1.16.x, a PEFT adapter or
`modules_to_save` on the student's LM head, a quantized LM head (student's or teacher's), models
without `lm_head` or backbone, FSDP1, FSDP2 with CPU offload, ZeRO-3 with a trainable head. A
teacher with another vocabulary, or with its head on another device, is refused by TRL itself.
"""

from __future__ import annotations

import functools
import types

import torch
import trl
from accelerate.utils import is_peft_model
from transformers.utils import logging
from trl.extras.profiling import profiling_context

from grpo_lce import linear_divergence

from .base import PackingOptionsMixin
from .head import check_fused_head, head_dtype_reason, head_inputs
from .models import unwrap_model
from .packing import packed_hidden, plan_packs
from .sampling.on_policy import OnPolicySamplingMixin
from .sharded import full_head_params

logger = logging.get_logger(__name__)

# The module-level function of trl/trainer/distillation_trainer.py that TRL's `_compute_loss`
# calls by name, and which `_compute_loss` below binds to ours.
_SEAM = "_chunked_divergence_loss"
_UNPACKABLE = (
    "grpo_lce packing skipped for a distillation batch whose attention_mask is not one "
    "contiguous run per row after a non-empty prompt; using padded backbone passes."
)


def _with_global(fn: types.FunctionType, name: str, value) -> types.FunctionType:
    """`fn` (same code, defaults and closure) whose global `name` is `value`: its globals are a
    copy of fn's module globals, so the module itself and every other caller are untouched."""
    scope = dict(fn.__globals__)
    scope[name] = value
    bound = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    bound.__kwdefaults__ = fn.__kwdefaults__
    return bound


def _seam_missing_reason(fn) -> str | None:
    """Why TRL's `_compute_loss` cannot be run with our loss in its place, or None."""
    if not isinstance(fn, types.FunctionType) or _SEAM not in fn.__code__.co_names:
        return f"trl.DistillationTrainer._compute_loss no longer calls {_SEAM} (a TRL change)"
    return None


def _logit_transform_reason(scales: dict, softcaps: dict) -> str | None:
    """What TRL asked for that grpo_lce's plain (h Wᵀ + b) / τ does not do, or None."""
    for who, scale in scales.items():
        if scale != 1.0:
            return f"the {who}'s logits are scaled by {scale}"
    for who, cap in softcaps.items():
        if cap is not None:
            return f"the {who}'s logits are softcapped at {cap}"
    return None


class DistillationTrainer(OnPolicySamplingMixin, PackingOptionsMixin, trl.DistillationTrainer):
    """`trl.DistillationTrainer` (1.16.x) whose divergence and entropy come from `grpo_lce`,
    and whose backbone passes are packed.

    Same constructor and config as `trl.DistillationTrainer`, plus the keywords `packing` and
    `max_packed_tokens` (`trainers.base.PackingOptionsMixin`), `fast_generation` and `sampler`
    (`trainers.sampling.on_policy`); see the module docstring for
    what is overridden, what falls back to TRL's loss and what is refused (`trainers.base`: the
    checks and fallback notices shared with the other trainers).
    """

    _trl_name = "DistillationTrainer"
    _trl_fallback = "TRL's own chunked divergence"
    _lce_logger = logger

    # "basis" or "chunked": grpo_lce.linear_divergence's implementation (its module docstring);
    # a class attribute so that a test can run both through the same trainer
    _lce_divergence_method = "basis"

    def __init__(self, *args, **kwargs):
        # PackingOptionsMixin, FusedHeadMixin: options, TRL version, TRL, student checks
        super().__init__(*args, **kwargs)
        if self.teacher_model is not None:
            check_fused_head(self.teacher_model)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields,
                              has_tool_images=False):
        sample = None if has_tool_images else self._lce_sample(prompt_ids, images,
                                                                 multimodal_fields)
        if sample is not None:
            return sample.token_ids
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields,
                                             has_tool_images=has_tool_images)

    def _get_last_hidden_state(self, unwrapped_model, input_ids, attention_mask, logits_to_keep,
                               **multimodal_inputs):
        """TRL's (B, K, H) backbone states at the K = `logits_to_keep` completion positions,
        from packed passes when this model packs (module docstring, "Packing"), else TRL's
        (profiled by TRL under this method's name either way)."""
        packs = None
        if all(v is None for v in multimodal_inputs.values()):
            packs = self._lce_pack_plan(unwrapped_model, input_ids, attention_mask,
                                        logits_to_keep)
        if packs is None:
            return super()._get_last_hidden_state(unwrapped_model, input_ids, attention_mask,
                                                  logits_to_keep, **multimodal_inputs)
        kind, plan = packs
        # the backbone TRL's `_get_last_hidden_state` calls
        lm = unwrapped_model.base_model.model if is_peft_model(unwrapped_model) else (
            unwrapped_model)
        backbone = lm.base_model

        def forward(inputs):  # (1, T, H) for one pack
            return backbone(**inputs, use_cache=False).last_hidden_state

        with profiling_context(self, "_get_last_hidden_state"):
            hidden = packed_hidden(plan, kind, forward)  # (N, H), in plan.out_index order
            out = hidden.new_zeros(plan.B * plan.K, hidden.shape[-1])
            return out.index_copy(0, plan.out_index, hidden).view(plan.B, plan.K, -1)

    def _lce_pack_plan(self, model, input_ids, attention_mask, K):
        """(packing kind, `trainers.packing.PackPlan` with a (B, K) output) for this model's
        pass, or None for TRL's padded pass (packing off or not chosen for this model, a mask
        that does not pack, no completion token, or under "auto" no padding to remove)."""
        kind = self._lce_packing_for(model)
        if kind is None:
            return None
        plan = plan_packs(input_ids, attention_mask, K,
                          max_tokens=self.max_packed_tokens or input_ids.numel(),
                          if_shorter=self._lce_pack_if_shorter)
        if plan is None:
            self._lce_packing_note(_UNPACKABLE)
            return None
        if not plan.packs:
            # no completion token (the padded pass gives TRL's zero-loss graph), or nothing
            # to remove
            return None
        return kind, plan

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        trl_method = trl.DistillationTrainer._compute_loss
        if self._lce_falls_back(_seam_missing_reason(trl_method)):
            return super()._compute_loss(unwrapped_student, inputs, num_items_in_batch)
        loss_fn = functools.partial(self._lce_divergence_loss, unwrapped_student)
        return _with_global(trl_method, _SEAM, loss_fn)(
            self, unwrapped_student, inputs, num_items_in_batch)

    def _lce_divergence_loss(
        self,
        student,
        student_hidden_states,
        teacher_hidden_states,
        student_lm_head_weight,
        teacher_lm_head_weight,
        completion_mask,
        beta,
        num_items_in_batch=None,
        student_lm_head_bias=None,
        teacher_lm_head_bias=None,
        student_logit_scale=1.0,
        teacher_logit_scale=1.0,
        student_final_logit_softcapping=None,
        teacher_final_logit_softcapping=None,
        temperature=1.0,
    ):
        """TRL's `_chunked_divergence_loss`, same arguments and results (module docstring);
        `student` is the unwrapped student model, bound by `_compute_loss`."""
        reason = _logit_transform_reason(
            {"student": student_logit_scale, "teacher": teacher_logit_scale},
            {"student": student_final_logit_softcapping,
             "teacher": teacher_final_logit_softcapping},
        ) or head_dtype_reason(student_lm_head_weight, "the student's") or head_dtype_reason(
            teacher_lm_head_weight, "the teacher's")
        if self._lce_falls_back(reason):
            trl_loss = trl.DistillationTrainer._compute_loss.__globals__[_SEAM]
            return trl_loss(
                student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                teacher_lm_head_weight, completion_mask, beta,
                num_items_in_batch=num_items_in_batch, student_lm_head_bias=student_lm_head_bias,
                teacher_lm_head_bias=teacher_lm_head_bias, student_logit_scale=student_logit_scale,
                teacher_logit_scale=teacher_logit_scale,
                student_final_logit_softcapping=student_final_logit_softcapping,
                teacher_final_logit_softcapping=teacher_final_logit_softcapping,
                temperature=temperature,
            )

        w_s, b_s = full_head_params(student_lm_head_weight, student_lm_head_bias, model=student)
        with torch.no_grad():  # the teacher's head is a constant (a ZeRO-3 gather is a copy)
            w_t, b_t = full_head_params(teacher_lm_head_weight, teacher_lm_head_bias,
                                        model=unwrap_model(self.teacher_model))
        h_s, b_s = head_inputs(student_hidden_states, w_s, b_s)
        h_t, b_t = head_inputs(teacher_hidden_states.detach(), w_t, b_t)
        mask = completion_mask.to(w_s.device)
        # the head's precision is fixed by grpo_lce (fp32 logits), not by an autocast region
        with torch.autocast(h_s.device.type, enabled=False):
            divergence, entropy = linear_divergence(
                h_s, w_s, h_t, w_t, beta=beta, mask=mask, student_bias=b_s, teacher_bias=b_t,
                temperature=temperature, return_entropy=True, method=self._lce_divergence_method,
            )
        n_valid = (mask != 0).sum()
        loss = divergence.sum()
        if num_items_in_batch is None:
            loss = loss / n_valid.clamp(min=1)  # a fully masked micro-batch gives 0, not 0/0
        else:
            if isinstance(num_items_in_batch, torch.Tensor):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss, entropy.sum(), n_valid
