"""SFTTrainer: TRL 1.16's SFTTrainer with the loss and metrics from `grpo_lce`.

    from trainers import SFTTrainer           # instead of: from trl import SFTTrainer

TRL 1.16's `SFTTrainer.compute_loss` is one method: it calls the model's patched forward with
`fused_lm_head=True`, builds the loss from the per-token log-probs and logs `entropy`,
`mean_token_accuracy` and `num_tokens`. There is no smaller hook, so `compute_loss` is the
method overridden; its default path (loss_type "nll" or "dft", no `compute_loss_func`, no label
smoothing) becomes

    h = backbone(**inputs without labels)[:, :-1]      (B, L-1, H)   through the wrapped model
    y = labels[:, 1:]   (or `shift_labels` as given)   −100: prompt / non-assistant / padding /
                                                       the first token of each packed sequence
    loss = Σ −log p(y) / d,   d = num_items_in_batch or #valid, clamped to ≥ 1
    (× world size with `average_tokens_across_devices`, + the MoE aux loss, as TRL does)

from `grpo_lce.linear_cross_entropy`, whose same pass also returns the argmax-correct count, the
entropy sum and the valid-token count. The metrics are then TRL's, to the letter:
`entropy` = Σ entropy / #valid and `mean_token_accuracy` = #correct / #valid, each numerator and
denominator summed over processes first; `num_tokens` = running count of attention-mask tokens
(or of packed positions when the batch is padding-free), summed over processes.

Falls back to TRL's own `compute_loss` (one warning per reason) for `compute_loss_func`, label
smoothing, DeepSpeed sequence parallelism, vision batches, other loss types, and models whose
logits are softcapped or scaled. Refused at construction as for `trainers.GRPOTrainer`.
"""

from __future__ import annotations

import warnings

import accelerate
import torch
import trl
from packaging.version import Version
from transformers.utils import logging

from .base import FusedHeadMixin
from .head import (
    forward_hidden_states,
    fused_head_unsupported_reason,
    head_cross_entropy,
    lm_head_params,
)

logger = logging.get_logger(__name__)

# Batch keys that are not model inputs: the labels go to the head, use_cache is set by us.
_NOT_MODEL_INPUTS = ("labels", "shift_labels", "use_cache")


class SFTTrainer(FusedHeadMixin, trl.SFTTrainer):
    """`trl.SFTTrainer` (1.16.x) whose loss and token metrics come from `grpo_lce`.

    Same constructor and config as `trl.SFTTrainer`; see the module docstring (and
    `trainers.base`: the checks at construction and fallback notices shared with GRPOTrainer).
    """

    _trl_name = "SFTTrainer"
    _trl_fallback = "TRL's own compute_loss"
    _lce_logger = logger

    def _lce_fallback_reason(self, model, inputs) -> str | None:
        if self.compute_loss_func is not None:
            return "compute_loss_func is set"
        if self.label_smoother is not None:
            return "label smoothing is on"
        if self.args.loss_type not in ("nll", "dft"):
            return f"loss_type={self.args.loss_type!r}"
        pc = getattr(self.accelerator, "parallelism_config", None)
        if (
            Version(accelerate.__version__) >= Version("1.12.0") and pc is not None
            and pc.sp_backend == "deepspeed" and pc.sp_enabled
        ):
            return "DeepSpeed sequence parallelism reduces the model's own loss"
        if "pixel_values" in inputs or getattr(self, "_is_vision_dataset", False):
            return "vision inputs"
        return fused_head_unsupported_reason(model)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._lce_falls_back(self._lce_fallback_reason(model, inputs)):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )

        mode = "train" if self.model.training else "eval"
        model_inputs = {k: v for k, v in inputs.items() if k not in _NOT_MODEL_INPUTS}
        if self.aux_loss_enabled:
            # MoE: the model's own forward then returns `aux_loss` (as TRL's fused forward does)
            model_inputs["output_router_logits"] = True
        hidden, outputs = forward_hidden_states(model, **model_inputs)
        if inputs.get("shift_labels") is not None:
            # context / sequence parallelism hand labels over already shifted; TRL scores them as is
            h, y = hidden, inputs["shift_labels"]
        else:
            # h_t predicts token t+1; in packed rows the label at each sequence start is −100,
            # so no row is trained to predict across a sequence boundary
            h, y = hidden[:, :-1], inputs["labels"][:, 1:]
        weight, bias = lm_head_params(model)

        # TRL clamps the divisor to ≥ 1 so a batch with no trainable token gives 0, not 0/0.
        divisor = None if num_items_in_batch is None else (
            torch.as_tensor(num_items_in_batch, device=weight.device).clamp(min=1)
        )
        if self.args.loss_type == "dft":
            # DFT (arXiv 2508.05629) weighs each token's NLL by its detached probability.
            nll, metrics = head_cross_entropy(
                h, weight, bias, y, reduction="none", return_metrics=True
            )
            if divisor is None:
                divisor = metrics["num_tokens"].clamp(min=1)
            loss = (nll * torch.exp(-nll).detach()).sum() / divisor
        else:
            loss, metrics = head_cross_entropy(
                h, weight, bias, y, reduction="mean", num_items=divisor, return_metrics=True
            )
        # Like `Trainer.compute_loss`: `num_items_in_batch` counts every rank's tokens, and DDP
        # averages the gradients across ranks.
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        if self.aux_loss_enabled:
            # a per-micro-batch mean; with num_items_in_batch, Trainer leaves accumulation to us
            steps = 1 if num_items_in_batch is None else self.current_gradient_accumulation_steps
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / steps

        self._log_token_metrics(mode, metrics, inputs)
        if self.aux_loss_enabled:
            aux = self.accelerator.gather_for_metrics(outputs.aux_loss).mean().item()
            self._metrics[mode]["aux_loss"].append(aux)

        if return_outputs:
            warnings.warn(
                "`return_outputs=True` needs the logits, which the fused head does not build, so "
                "they are recomputed with an extra forward pass (as in trl.SFTTrainer).",
                FutureWarning,
                stacklevel=2,
            )
            with torch.no_grad():
                outputs = model(**model_inputs, use_cache=False)
        return (loss, outputs) if return_outputs else loss

    def _log_token_metrics(self, mode: str, metrics: dict, inputs: dict) -> None:
        """TRL 1.16's `entropy`, `mean_token_accuracy` and `num_tokens`, same semantics."""
        gather = self.accelerator.gather_for_metrics
        num_valid = gather(metrics["num_tokens"]).sum()
        entropy_sum = gather(metrics["entropy_sum"].detach()).sum()
        num_correct = gather(metrics["correct"]).sum()
        self._metrics[mode]["entropy"].append(
            (entropy_sum / num_valid).item() if num_valid > 0 else 0.0
        )
        self._metrics[mode]["mean_token_accuracy"].append(
            (num_correct / num_valid).item() if num_valid > 0 else 0.0
        )
        if mode == "train":
            # Padding-free batches carry position_ids instead of an attention mask; every
            # packed position is a real token then.
            if "attention_mask" in inputs:
                n = gather(inputs["attention_mask"].sum()).sum().item()
            elif "position_ids" in inputs:
                pos = inputs["position_ids"]
                n = gather(torch.tensor(pos.size(1), device=pos.device)).sum().item()
            else:
                raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
            self._total_train_tokens += n // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
