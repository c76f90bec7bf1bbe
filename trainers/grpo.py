"""GRPOTrainer: TRL 1.16's GRPOTrainer with the per-token log-probs from `grpo_lce` and its
on-policy samples from our decode loop. Change one import and nothing else:

    from trainers import GRPOTrainer          # instead of: from trl import GRPOTrainer

`_get_per_token_logps_and_entropies(model, input_ids, attention_mask, K, ...)` is the one
log-prob method TRL calls (the loss's policy pass with entropy, old policy, reference), and the
only log-prob method overridden. Per row chunk of `batch_size` sequences:

    h = backbone(input_ids)[:, -K-1:-1]          (B, K, H)   K = logits_to_keep
    y = input_ids[:, -K:], −100 where attention_mask is 0
    logp, H = linear_logprobs(h, W, y, bias=b, temperature=τ, return_entropy=...)   (B, K) fp32

TRL's own fused head's results (0 at masked positions) without a (B, K, V) tensor; h comes
through the wrapped model's forward (`trainers.head`), so DDP, PEFT, 4-bit and gradient
checkpointing act as in TRL, whose loss code is untouched. Packed (`packing`:
`trainers.packing.packed_logprobs`) where `trainers.attention` decides the model packs, never
for the MoE aux-loss pass.

Sampling (`fast_generation`, `sampler`: `trainers.sampling.on_policy`): our decode loop, else the
compiled FastSampler, else TRL's; the loop's log-probs feed TRL's importance-sampling correction
(`sampler_importance_sampling_correction`: `trainers.sampling.correction`).

Falls back to TRL's head, one warning per reason: multimodal inputs, logits softcapped or scaled
before the softmax, a head in a dtype grpo_lce does not take (float64). Refused at construction
(`trainers.base`): TRL outside 1.16.x, an adapted, quantized or missing LM head, FSDP1, FSDP2 with
CPU offload, DeepSpeed ZeRO-3 with a trainable head.
"""

from __future__ import annotations

import torch
import trl
from transformers.utils import logging

from .base import FusedHeadMixin
from .config import check_max_packed_tokens, normalize_packing
from .head import (
    forward_hidden_states,
    fused_head_unsupported_reason,
    head_logprobs,
    lm_head_params,
)
from .packing import packed_logprobs
from .sampling.correction import SamplerCorrection
from .sampling.on_policy import OnPolicySamplingMixin

logger = logging.get_logger(__name__)


class GRPOTrainer(OnPolicySamplingMixin, FusedHeadMixin, trl.GRPOTrainer):
    """`trl.GRPOTrainer` (1.16.x) whose log-probs and entropies come from `grpo_lce`, and whose
    on-policy samples come from our decode loop or a compiled decode step on CUDA.

    Same constructor and config as `trl.GRPOTrainer`. Five options, read from a
    `trainers.GRPOConfig` (stock `trl.GRPOConfig`: their defaults) or given as keywords, which
    win over the config:

        packing: "auto" (default), True or False — padding-free log-prob passes (module
            docstring; "auto": for batches with padding to remove); also settable later as the
            attribute `trainer.packing`.
        max_packed_tokens: tokens per packed forward; None (default) = TRL's chunk,
            `batch_size · L`, so a pack never outgrows the padded chunk it replaces.
        fast_generation: True (default) — on CUDA, sample with our samplers (`sampler`);
            False — TRL's own sampling.
        sampler: "auto" (default: our decode loop, then the compiled FastSampler, then TRL's
            generate), "loop", "compiled" or "trl" (`trainers.sampling.serve`).
        sampler_importance_sampling_correction: True (default) — the decode loop's
            log-probs feed TRL's importance-sampling correction (module docstring).

    See the module docstring for what is overridden, what falls back to TRL's head and what is
    refused (`trainers.base`: the checks, fallback notices and packing decision all six
    trainers share).
    """

    _trl_name = "GRPOTrainer"
    _trl_fallback = "TRL's own fused head"
    _lce_logger = logger

    def __init__(self, *args, packing: bool | str | None = None,
                 max_packed_tokens: int | None = None,
                 sampler_importance_sampling_correction: bool | None = None, **kwargs):
        if packing is not None:
            packing = normalize_packing(packing)
        check_max_packed_tokens(max_packed_tokens)
        correction = sampler_importance_sampling_correction
        if correction is not None and not isinstance(correction, bool):
            raise ValueError("sampler_importance_sampling_correction must be True or False, "
                             f"got {correction!r}")
        # OnPolicySamplingMixin: fast_generation=, sampler=; FusedHeadMixin: TRL version, TRL,
        # fused-head checks
        super().__init__(*args, **kwargs)
        self.packing = packing if packing is not None else getattr(self.args, "packing", "auto")
        self.max_packed_tokens = (max_packed_tokens if max_packed_tokens is not None
                                  else getattr(self.args, "max_packed_tokens", None))
        if correction is None:
            correction = getattr(self.args, "sampler_importance_sampling_correction", True)
        self._lce_correction = SamplerCorrection(self, enabled=correction)

    def _lce_fallback_reason(self, model, multimodal_inputs: dict) -> str | None:
        present = sorted(k for k, v in multimodal_inputs.items() if v is not None)
        if present:
            return f"multimodal inputs ({', '.join(present)})"
        return fused_head_unsupported_reason(model)

    def _lce_packing_kind(self, model, compute_aux_loss: bool) -> str | None:
        """How to pack for `model` ("varlen", "block", "sdpa_varlen", "dense"), or None for the
        padded path: the model's decision (`FusedHeadMixin._lce_packing_for`) unless this is
        the MoE aux-loss pass."""
        if compute_aux_loss and self.packing is not False:
            self._lce_packing_note(
                "grpo_lce packing off for the MoE aux-loss pass (the router's load-balancing loss "
                "is defined on padded rows); using padded forwards.")
            return None
        return self._lce_packing_for(model)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        """(logps (B, K) fp32, entropies (B, K) or None, aux_loss or None), as TRL's method
        returns them: 0 at positions whose attention_mask is 0. In a loss whose
        importance-sampling ratio waits for its policy log-probs, these are they
        (`trainers.sampling.correction`)."""
        out = self._lce_logps_and_entropies(*args, **kwargs)
        self._lce_correction.policy_logprobs(out[0])
        return out

    def _lce_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal_inputs,
    ):
        if self._lce_falls_back(self._lce_fallback_reason(model, multimodal_inputs)):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss,
                **multimodal_inputs,
            )

        K = logits_to_keep
        weight, bias = lm_head_params(model)
        # The entropy basis costs one more GEMM in the forward; build it only when TRL's entropy
        # bonus will backpropagate through the entropy (otherwise it is recomputed if needed).
        entropy_grad = (
            compute_entropy and torch.is_grad_enabled()
            and bool(getattr(self, "_entropy_bonus_enabled", False))
        )
        head_kwargs = dict(temperature=self.temperature, return_entropy=compute_entropy,
                           entropy_requires_grad=entropy_grad)
        batch_size = batch_size or input_ids.size(0)

        kind = self._lce_packing_kind(model, compute_aux_loss)
        if kind is not None:
            packed, note = packed_logprobs(
                model, input_ids, attention_mask, K, kind=kind, weight=weight, bias=bias,
                max_tokens=self.max_packed_tokens or batch_size * input_ids.size(1),
                autocast=self.accelerator.autocast, if_shorter=self._lce_pack_if_shorter,
                **head_kwargs,
            )
            if note is not None:
                self._lce_packing_note(note)
            if packed is not None:  # else the padded forwards below
                return (*packed, None)
        all_logps, all_entropies, all_aux = [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids = input_ids[start:start + batch_size]
            mask = attention_mask[start:start + batch_size]
            model_inputs = {"input_ids": ids, "attention_mask": mask}
            if compute_aux_loss:
                model_inputs["output_router_logits"] = True
            with self.accelerator.autocast():
                hidden, outputs = forward_hidden_states(model, **model_inputs)
            # Position t predicts token t+1, so the K completion tokens are scored by the K
            # hidden states before them. Padded completion positions are ignored (logp 0).
            h = hidden[:, -K - 1:-1]  # (b, K, H)
            y = ids[:, -K:].masked_fill(mask[:, -K:] == 0, -100)  # (b, K)
            out = head_logprobs(h, weight, bias, y, **head_kwargs)
            logps, entropies = out if compute_entropy else (out, None)
            all_logps.append(logps)
            if compute_entropy:
                all_entropies.append(entropies)
            if compute_aux_loss:
                all_aux.append(outputs.aux_loss)

        logps = torch.cat(all_logps, dim=0)
        entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
        aux_loss = torch.stack(all_aux).mean() if compute_aux_loss else None
        return logps, entropies, aux_loss

    # ------------------------------------------------------------------ generation

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                              has_tool_images=False):
        """TRL's regular (non-vLLM) generation served by our samplers
        (`trainers.sampling.on_policy`): the same left-padded prompts, generation config and
        EOS trimming; with the decode loop's log-probs when they feed the importance-sampling
        correction (`trainers.sampling.correction`). Anything our samplers do not serve goes
        to TRL's own method."""
        sample = self._lce_sample(prompt_ids, images, multimodal_fields)
        if sample is not None:
            return sample.token_ids, self._lce_correction.logprobs(sample)
        completion_ids, logprobs = super()._generate_single_turn(
            prompt_ids, images, multimodal_fields, num_generations,
            has_tool_images=has_tool_images)
        return completion_ids, self._lce_correction.fallback_logprobs(completion_ids, logprobs)

    def _generate(self, prompts: list):
        """TRL's `_generate` (timed by `OnPolicySamplingMixin`); when the decode loop's
        log-probs were fed, TRL's importance-sampling branch runs for the rest of this
        `_generate_and_score_completions` call."""
        self._lce_correction.start_call()
        out = super()._generate(prompts)
        self._lce_correction.end_call()
        return out

    def _generate_and_score_completions(self, inputs):
        with self._lce_correction.scoring():
            return super()._generate_and_score_completions(inputs)

    def _compute_loss(self, model, inputs):
        inputs = dict(inputs)  # a deferred ratio is added to this loss's inputs only
        with self._lce_correction.loss(inputs):
            return super()._compute_loss(model, inputs)
