"""Liger loss in a TRL trainer subclass (bench only): stock TRL 1.16 trainers whose loss is
Liger-Kernel's fused linear loss, for bench.trainer_step's `liger` system.

Why subclasses. TRL 1.16 no longer offers Liger's losses through its configs: `DPOConfig` has no
`use_liger_loss`, and `use_liger_kernel=True` (deprecated) applies only Liger's layer kernels and
refuses `liger_kernel_config={"fused_linear_cross_entropy": True}`, because the trainer patches
the model with its own fused LM head (trl/trainer/dpo_trainer.py); `DistillationConfig` has no
Liger option at all and its loss is TRL's `ChunkedDivergenceFunction`
(trl/trainer/distillation_trainer.py). So each class below overrides the one method that builds
the loss, `_compute_loss`, and leaves TRL everything else: data preparation and collation, the
PEFT reference (adapter disabled), the teacher's placement, generation, optimizer, logging.

    LigerDPOTrainer           policy hidden states h (backbone with the adapter, autograd) and
                              reference hidden states h_ref (adapter disabled, no grad), then
                              LigerFusedLinearDPOLoss(W, h[:, :-1], labels[:, 1:],
                              ref_input=h_ref[:, :-1], ref_weight=W): loss "sigmoid", summed
                              log-probs (average_log_prob=False), no NLL term: TRL's default
                              DPO loss. Other loss types and options are refused.
    LigerDistillationTrainer  TRL's own student and teacher hidden states
                              (`_get_last_hidden_state`), then LigerFusedLinearJSDLoss with
                              weight_hard_loss=0, weight_soft_loss=1, TRL's beta and temperature,
                              on the flattened completion rows (label -100 where the loss mask is
                              0): TRL's loss, mean over the valid tokens. Liger gives no entropy,
                              so TRL's logged `entropy` is 0.

Liger's losses take the backbone's hidden states, so the backbone is called directly (as TRL's
distillation trainer does), inside `accelerator.autocast()` as the prepared model's forward
would be; the bench runs one process on one GPU, where no DDP wrapper is skipped.
`compiled` is Liger's torch.compile switch (its default, True, on CUDA).
"""

from __future__ import annotations

import torch
import trl
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from trainers.models import backbone, unwrap_causal_lm


def _hidden(model, input_ids, attention_mask) -> torch.Tensor:
    """The backbone's last hidden state (B, T, H) of `model` (PEFT adapters as set)."""
    out = backbone(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state


class LigerDPOTrainer(trl.DPOTrainer):
    """trl.DPOTrainer with LigerFusedLinearDPOLoss as the loss (module docstring)."""

    def __init__(self, *args, compiled: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        a = self.args
        unsupported = {
            "loss_type": (self.loss_types, ["sigmoid"]), "ld_alpha": (self.ld_alpha, None),
            "f_divergence_type": (self.f_divergence_type, "reverse_kl"),
            "use_weighting": (self.use_weighting, False),
            "precompute_ref_log_probs": (a.precompute_ref_log_probs, False),
            "ref_model": (self.ref_model, None),
        }
        for name, (value, default) in unsupported.items():
            if value != default:
                raise ValueError(f"LigerDPOTrainer supports only {name}={default!r}, got {value!r}")
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

        self._liger_loss = LigerFusedLinearDPOLoss(
            beta=self.beta, compute_nll_loss=False, average_log_prob=False, use_ref_model=True,
            loss_type="sigmoid", compiled=compiled)

    def _compute_loss(self, model, inputs, return_outputs):
        if return_outputs:
            raise ValueError("LigerDPOTrainer does not return outputs")
        mode = "train" if self.model.training else "eval"
        ids, attn = inputs["input_ids"], inputs["attention_mask"]
        labels = ids.masked_fill(inputs["completion_mask"] == 0, -100)[:, 1:]  # (2B, T-1)
        unwrapped = self.accelerator.unwrap_model(model)
        with self.accelerator.autocast():
            h = _hidden(unwrapped, ids, attn)[:, :-1]  # (2B, T-1, H), chosen rows first
            with (torch.no_grad(),
                  disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
                  use_adapter(unwrapped, adapter_name=None)):
                h_ref = _hidden(unwrapped, ids, attn)[:, :-1]  # (2B, T-1, H)
        head = unwrap_causal_lm(unwrapped).get_output_embeddings()
        W, b = head.weight, head.bias
        loss, aux = self._liger_loss(W, h, labels, b, ref_input=h_ref, ref_weight=W, ref_bias=b)
        chosen_logps, rejected_logps, *_, chosen_rewards, rejected_rewards = aux
        gather = self.accelerator.gather
        m = self._metrics[mode]
        m["rewards/chosen"].append(gather(chosen_rewards.detach()).mean().item())
        m["rewards/rejected"].append(gather(rejected_rewards.detach()).mean().item())
        m["rewards/margins"].append(gather((chosen_rewards - rejected_rewards).detach())
                                    .mean().item())
        m["logps/chosen"].append(gather(chosen_logps.detach()).mean().item())
        m["logps/rejected"].append(gather(rejected_logps.detach()).mean().item())
        return loss


class LigerDistillationTrainer(trl.DistillationTrainer):
    """trl.DistillationTrainer with LigerFusedLinearJSDLoss as the loss (module docstring)."""

    def __init__(self, *args, compiled: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        self._liger_loss = LigerFusedLinearJSDLoss(
            weight_hard_loss=0.0, weight_soft_loss=1.0, beta=self.beta,
            temperature=self.temperature, compiled=compiled)

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        loss_mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            loss_mask = loss_mask * inputs["tool_mask"]
        K = inputs["completion_ids"].size(1)
        h_s = self._get_last_hidden_state(unwrapped_student, ids, attn, K)  # (B, K, H_s)
        self.teacher_model.eval()
        teacher = self.accelerator.unwrap_model(self.teacher_model)
        with torch.no_grad():
            h_t = self._forward_redirection(self.teacher_model, teacher,
                                            self._get_last_hidden_state, teacher, ids, attn, K)
        s_head = unwrapped_student.get_output_embeddings()
        t_head = teacher.get_output_embeddings()
        labels = inputs["completion_ids"].masked_fill(loss_mask == 0, -100).reshape(-1)  # (B·K,)
        loss = self._liger_loss(h_s.reshape(-1, h_s.size(-1)), s_head.weight,
                                h_t.reshape(-1, h_t.size(-1)), t_head.weight, labels,
                                s_head.bias, t_head.bias)
        n_valid = (loss_mask != 0).sum()
        return loss, torch.zeros((), device=loss.device), n_valid
