"""GRPOTrainer: TRL 1.16's GRPOTrainer with the per-token log-probs from `grpo_lce`.

Change one import and nothing else:

    from trainers import GRPOTrainer          # instead of: from trl import GRPOTrainer

Every log-probability TRL asks for goes through one method,
`_get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, ...)`:
the training loss (policy, with entropy), the old-policy pass (no grad) and the reference pass
(a separate `ref_model`, or the PEFT model under `use_adapter(..., None)` / the "ref"
adapter). That is the only method overridden. Per row chunk of `batch_size` sequences:

    h = backbone(input_ids)[:, -K-1:-1]          (B, K, H)   K = logits_to_keep completion tokens
    y = input_ids[:, -K:], −100 where attention_mask is 0
    logp, H = linear_logprobs(h, W, y, bias=b, temperature=τ, return_entropy=...)   (B, K) fp32

which is what TRL's own fused head returns (0 at masked positions), without any (B, K, V)
tensor. h comes through the wrapped model's forward (see `trainers.head`), so DDP, PEFT,
bitsandbytes 4-bit and gradient checkpointing act as in stock TRL; generation never passes here.

TRL's loss code stays in charge of everything else: loss types, β and the KL, ε / ε_high / δ
clipping, token or sequence importance sampling, `top_entropy_quantile`, the entropy bonus,
gradient accumulation, `steps_per_generation`, vLLM importance sampling and every metric. No
loss math is reproduced here.

Falls back to TRL's own (chunked, also logit-free) head, with one warning per reason, for:
multimodal inputs (`pixel_values` and friends), and models whose logits are transformed before
the softmax (final-logit softcapping or a logit scale, e.g. Gemma 2, Cohere, Granite).
Refused at construction: TRL outside 1.16.x, a PEFT adapter or `modules_to_save` on the LM head,
a quantized LM head, models without `lm_head` or backbone, FSDP and DeepSpeed ZeRO-3 (their
parameters are sharded outside the module's forward).
"""

from __future__ import annotations

import torch
import trl
from transformers.utils import logging

from trainers._version import check_trl_version
from trainers.head import (
    check_fused_head,
    check_parallelism,
    forward_hidden_states,
    fused_head_unsupported_reason,
    head_logprobs,
    lm_head_params,
)

logger = logging.get_logger(__name__)


class GRPOTrainer(trl.GRPOTrainer):
    """`trl.GRPOTrainer` (1.16.x) whose log-probs and entropies come from `grpo_lce`.

    Same constructor and config as `trl.GRPOTrainer`. See the module docstring for what is
    overridden, what falls back to TRL's head and what is refused.
    """

    def __init__(self, *args, **kwargs):
        check_trl_version("GRPOTrainer")
        super().__init__(*args, **kwargs)
        check_fused_head(self.model)
        if self.ref_model is not None:
            check_fused_head(self.ref_model)
        check_parallelism(self)
        self._lce_fallbacks_logged: set[str] = set()

    def _lce_fallback_reason(self, model, multimodal_inputs: dict) -> str | None:
        present = sorted(k for k, v in multimodal_inputs.items() if v is not None)
        if present:
            return f"multimodal inputs ({', '.join(present)})"
        return fused_head_unsupported_reason(model)

    def _get_per_token_logps_and_entropies(
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
        """(logps (B, K) fp32, entropies (B, K) or None, aux_loss or None), as TRL's method
        returns them: 0 at positions whose attention_mask is 0."""
        reason = self._lce_fallback_reason(model, multimodal_inputs)
        if reason is not None:
            if reason not in self._lce_fallbacks_logged:
                self._lce_fallbacks_logged.add(reason)
                logger.warning(f"grpo_lce head not used ({reason}); using TRL's own fused head.")
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
        batch_size = batch_size or input_ids.size(0)
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
            out = head_logprobs(
                h, weight, bias, y, temperature=self.temperature,
                return_entropy=compute_entropy, entropy_requires_grad=entropy_grad,
            )
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
