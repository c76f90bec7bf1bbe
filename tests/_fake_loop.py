"""Test doubles of the samplers `trainers.sampling.serve` chooses between, with their APIs:

- `FakeDecodeLoop`: `trainers.sampling.loop.DecodeLoop`'s API (disabled_reason, stats,
  unsupported_reason, generate -> Completions or None), served by HF eager `generate` with
  `output_scores`: each token's log-prob is log_softmax of the scores it was sampled from
  (transformers' processed scores: after temperature, top-k / top-p and the other
  processors), plus an optional known `shift(b, t)` so tests can check what reaches TRL.
- `FakeCompiled`: `trainers.generation.FastSampler`'s API (disabled_reason, stats, disable,
  generate -> prompt + completions or None), served by eager `generate`.

Both record their calls, so a test can assert which sampler ran.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)


@dataclasses.dataclass
class LoopStats:
    calls: int = 0
    captures: int = 0
    capture_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    host_checks: int = 0


@dataclasses.dataclass
class Completions:
    token_ids: list[list[int]]
    logprobs: list[list[float]]


def _eos_ids(config) -> list[int]:
    eos = config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


class FakeDecodeLoop:
    """See the module docstring. `unsupported`: what `unsupported_reason` answers;
    `decline_after`: calls served before `generate` returns None, sets `disabled_reason` and
    logs one line (as DecodeLoop does);
    `raises`: an exception `generate` raises; `drop_last_logprob`: a malformed result."""

    def __init__(self, *, unsupported=None, decline_after=None, raises=None, shift=None,
                 drop_last_logprob=False):
        self.disabled_reason = None
        self.stats = LoopStats()
        self.unsupported = unsupported
        self.decline_after = decline_after
        self.raises = raises
        self.shift = shift
        self.drop_last_logprob = drop_last_logprob
        self.asked = 0  # generate calls, served or not
        self.returned: list[Completions] = []

    def unsupported_reason(self, model, generation_config):
        return self.unsupported

    @torch.no_grad()
    def generate(self, model, input_ids, attention_mask, generation_config):
        self.asked += 1
        if self.raises is not None:
            raise self.raises
        if self.decline_after is not None and self.stats.calls >= self.decline_after:
            # as DecodeLoop.disable: the reason, and one logged line of its own
            self.disabled_reason = "the fake loop turned itself off"
            logger.warning(f"fake decode loop off ({self.disabled_reason})")
            return None
        config = copy.deepcopy(generation_config)
        config.output_scores, config.return_dict_in_generate = True, True
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                             generation_config=config)
        completions = out.sequences[:, input_ids.size(1):]  # (B, S)
        scores = torch.stack(out.scores, dim=1).float()  # (B, S, V) processed logits
        logps = scores.log_softmax(-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        eos = _eos_ids(generation_config)
        ids, lps = [], []
        for b, (row, lp) in enumerate(zip(completions.tolist(), logps.tolist())):
            n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            lp = lp[:n]
            if self.shift is not None:
                lp = [x + self.shift(b, t) for t, x in enumerate(lp)]
            ids.append(row[:n])
            lps.append(lp[:-1] if self.drop_last_logprob else lp)
        self.stats.calls += 1
        self.stats.captures = max(self.stats.captures, 1)
        self.stats.steps += completions.size(1)
        result = Completions(ids, lps)
        self.returned.append(result)
        return result


@dataclasses.dataclass
class CompiledStats:
    calls: int = 0
    compiles: int = 0
    compile_s: float = 0.0


class FakeCompiled:
    """See the module docstring. `decline`: `generate` returns None (a prompt that does not
    fit, say) without turning itself off."""

    def __init__(self, *, decline=False):
        self.disabled_reason = None
        self.stats = CompiledStats()
        self.decline = decline
        self.asked = 0

    def disable(self, reason):
        self.disabled_reason = self.disabled_reason or reason

    @torch.no_grad()
    def generate(self, model, input_ids, attention_mask, generation_config):
        self.asked += 1
        if self.decline or self.disabled_reason is not None:
            return None
        self.stats.calls += 1
        return model.generate(input_ids=input_ids, attention_mask=attention_mask,
                              generation_config=generation_config)
