"""KTOTrainer: TRL 1.16's KTOTrainer with every log-prob from `grpo_lce`.

    from trainers import KTOTrainer           # instead of: from trl import KTOTrainer

Overridden: nothing of TRL's loss. As for `trainers.DPOTrainer`, the one seam is the fused LM
head forward TRL puts on the policy and the reference model (`trainers.fused_forward`), replaced
by ours after TRL's `__init__` and before TRL precomputes reference log-probs inside it. The
completion pass, the KL pass (mismatched completions) and the reference passes then get their
`log_probs`, `entropy` and `mean_logits` from `grpo_lce.linear_logprobs` on the labelled rows.

TRL stays in charge of everything else: `loss_type` ("kto", "apo_zero_unpaired"), β,
`desirable_weight` / `undesirable_weight`, the KL estimate, the reference as a `ref_model`, a
disabled adapter or a "ref" adapter, `precompute_ref_log_probs`, the MoE aux loss and every
metric.

Options of ours, as for `trainers.DPOTrainer`: `packing="auto"` and `max_packed_tokens=None`
(the completion and KL passes packed alike).

Falls back to TRL's own fused head, one logged line per reason, for: multimodal inputs, MoE
router logits, logits softcapped or scaled before the softmax. Refused at construction as for
`trainers.DPOTrainer`.
"""

from __future__ import annotations

import trl
from transformers.utils import logging

from . import fused_forward

logger = logging.get_logger(__name__)


class KTOTrainer(fused_forward.FusedForwardMixin, trl.KTOTrainer):
    """`trl.KTOTrainer` (1.16.x) whose log-probs come from `grpo_lce`; same constructor and
    config. See the module docstring."""

    _trl_name = "KTOTrainer"
    _lce_logger = logger
