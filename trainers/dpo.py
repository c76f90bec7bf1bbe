"""DPOTrainer: TRL 1.16's DPOTrainer with every log-prob from `grpo_lce`.

    from trainers import DPOTrainer           # instead of: from trl import DPOTrainer

Overridden: nothing of TRL's loss. The one seam is the fused LM head forward TRL puts on the
policy and the reference model in `__init__` (`trainers.fused_forward`): after TRL's
`__init__` (and before TRL precomputes reference log-probs, which it does inside it) our
forward replaces TRL's on exactly those models. Every `model(..., labels=..., fused_lm_head=True)`
call of TRL's code then gets its `log_probs`, `entropy`, `mean_logits`, `is_top1` and, with
WPO (`use_weighting`), `log_sum_sq_probs` from `grpo_lce.linear_logprobs` on the labelled
rows only, with the semantics TRL documents for `FusedCausalLMOutput`.

So TRL stays in charge of everything else: every `loss_type` (and their weighted mixtures),
β, f-divergences, label smoothing, LD-DPO's `ld_alpha`, WPO, the MoE aux loss, the reference as
a `ref_model`, a disabled adapter or a "ref" adapter, `precompute_ref_log_probs`,
`sync_ref_model`, and every metric (`logits/*` from mean_logits, `mean_token_accuracy` from
is_top1, `entropy`). `padding_free=True` is TRL's to handle: 1.16 turns it off itself with a
warning, and so does this trainer.

Two options of ours, as constructor keywords (`trainers.fused_forward.FusedForwardMixin`):
`packing="auto"` (padding-free backbone passes over the valid tokens of the right-padded
chosen / rejected rows, where the attention keeps packed rows apart: sdpa on CUDA in bf16 / fp16,
flash or flex attention; True or False to force) and `max_packed_tokens=None`.

Falls back to TRL's own fused head, one logged line per reason, for: multimodal inputs, MoE
router logits, logits softcapped or scaled before the softmax (Gemma 2, Cohere, Granite, ...).
Refused at construction (`trainers.base`): TRL outside 1.16.x, a PEFT adapter or
`modules_to_save` on the LM head, a quantized LM head, models without `lm_head` or backbone,
FSDP1, FSDP2 with CPU offload, ZeRO-3 with a trainable head; and here, before TRL's `__init__`,
`use_weighting=True` with "sft" among the loss types, which TRL 1.16's own loss cannot run (it
scales the SFT term, a scalar expanded to the batch, by the WPO weights in place).
"""

from __future__ import annotations

import trl
from transformers.utils import logging

from . import fused_forward

logger = logging.get_logger(__name__)


class DPOTrainer(fused_forward.FusedForwardMixin, trl.DPOTrainer):
    """`trl.DPOTrainer` (1.16.x) whose log-probs come from `grpo_lce`; same constructor and
    config. See the module docstring."""

    _trl_name = "DPOTrainer"
    _lce_logger = logger

    def __init__(self, *args, **kwargs):
        # trl.DPOTrainer(model, ref_model, args, ...): the config is the third positional
        config = kwargs["args"] if "args" in kwargs else (args[2] if len(args) > 2 else None)
        check_weighting(config)
        super().__init__(*args, **kwargs)


def check_weighting(config) -> None:
    """Refuse `use_weighting=True` with "sft" in `loss_type` (module docstring): TRL 1.16's
    loss raises a RuntimeError there at the first step, after the models and data are set up."""
    if config is None or not getattr(config, "use_weighting", False):
        return
    loss_types = config.loss_type if isinstance(config.loss_type, list) else [config.loss_type]
    if "sft" in loss_types:
        raise ValueError(
            f"trainers.DPOTrainer: use_weighting=True with loss_type={config.loss_type!r} is not "
            "supported: TRL 1.16's DPO loss cannot weight the 'sft' term (it raises at the first "
            "step). Set use_weighting=False, or drop 'sft' from loss_type.")
