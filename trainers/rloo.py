"""RLOOTrainer: TRL 1.16's RLOOTrainer with every log-prob from `grpo_lce`.

    from trainers import RLOOTrainer          # instead of: from trl import RLOOTrainer

Overridden: nothing of TRL's loss. As for `trainers.DPOTrainer`, the one seam is
the fused LM head forward TRL puts on the policy and the reference model, at TRL's sampling
temperature (`trainers.fused_forward`), replaced by ours after TRL's `__init__`. TRL's
`_get_per_token_logps_and_entropies` (the policy pass with entropy, the old-policy and
reference passes) then gets `log_probs` and `entropy` from `grpo_lce.linear_logprobs` on the
completion tokens only.

Sampling: `_generate_single_turn` (TRL's regular generation path) is served by our samplers, as
in `trainers.GRPOTrainer` (`trainers.sampling.on_policy`: options `fast_generation=True` and
`sampler="auto"`, metrics `timing/generation_s` and `fast_generation/*`); vLLM, continuous
batching and multimodal prompts stay TRL's. RLOO has no importance-sampling correction in TRL
1.16, so no sampler log-probs are used.

TRL stays in charge of everything else: rewards, the
leave-one-out baseline, `normalize_advantages`, `reward_clip_range`, the KL penalty β in the
reward, ε-low / ε-high clipping of the sequence ratio, `mask_truncated_completions`,
`steps_per_generation`, the MoE aux loss and every metric.

Options of ours, as for `trainers.DPOTrainer`: `packing="auto"` and `max_packed_tokens=None`
(each of TRL's row chunks packed: left-padded prompts and right-padded completions alike); and
`fast_generation`, `sampler` (above).

Falls back to TRL's own fused head, one logged line per reason, for: multimodal inputs, MoE
router logits, logits softcapped or scaled before the softmax. Refused at construction as for
`trainers.DPOTrainer`.
"""

from __future__ import annotations

import trl
from transformers.utils import logging

from . import fused_forward
from .sampling.on_policy import OnPolicySamplingMixin

logger = logging.get_logger(__name__)


class RLOOTrainer(OnPolicySamplingMixin, fused_forward.FusedForwardMixin, trl.RLOOTrainer):
    """`trl.RLOOTrainer` (1.16.x) whose log-probs come from `grpo_lce` and whose samples come
    from our samplers; same constructor and config. See the module docstring."""

    _trl_name = "RLOOTrainer"
    _lce_logger = logger

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        sample = self._lce_sample(prompt_ids, images, multimodal_fields)
        if sample is not None:
            return sample.token_ids
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields)
