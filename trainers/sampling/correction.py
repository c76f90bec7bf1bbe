"""The decode loop's exact sampling log-probs into TRL 1.16's importance-sampling correction,
without vLLM (`trainers.GRPOTrainer`).

TRL's correction for the sampler-trainer mismatch, per completion token t (mask m_t):

    δ_t = (old_logp_t − sampling_logp_t) · m_t         old: the trainer's no-grad pass
    ρ   = exp(δ_t)         token_* modes,    (B, T)
          exp(Σ_t δ_t)     sequence_* modes, (B, 1)
    ρ ← clamp(ρ, C_min, C_max)         *_truncate
    ρ ← ρ · [C_min ≤ ρ ≤ C_max]        *_mask
    per-token loss ← per-token loss · ρ        (VESPO instead reads ρ in its gamma weights)

with the metrics `sampling/sampling_logp_difference/{mean,max}` (|δ| over valid tokens) and
`sampling/importance_sampling_ratio/{min,mean,max}`. `vllm_importance_sampling_mode`,
`_clip_min` and `_clip_max` choose the mode and the bounds. TRL computes all of it in
`_generate_and_score_completions` (and applies ρ in `_compute_loss`) from the log-probs
`_generate_single_turn` returns, behind the test `self.use_vllm and
self.vllm_importance_sampling_correction`; no method computes ρ on its own, and the loss code
is not reproduced here. So, when our decode loop served a call and the switch
`sampler_importance_sampling_correction` is on (default True, TRL's default for vLLM):

- `_generate_single_turn` returns the loop's log-probs (TRL then pads them into
  `sampling_per_token_logps`, as vLLM's);
- from the end of `_generate` to the end of that `_generate_and_score_completions`, and around
  a `_compute_loss` whose inputs carry the ratio ρ, the trainer's two instance attributes
  `use_vllm` and `vllm_importance_sampling_correction` read True (`_Gate`: saved and restored,
  also on an exception). After `_generate` TRL reads `use_vllm` only for the correction (the
  old-policy pass it needs, ρ, the metrics, the outputs), and in `_compute_loss` only to apply
  ρ; sampling itself never runs with the gate open.

Otherwise `_generate_single_turn` returns what TRL's regular path returns (no log-probs), and
TRL's behaviour is unchanged: a call served by FastSampler or TRL's generate, the switch off,
or vLLM (whose own log-probs and gate are left alone).

The log-probs are the loop's: each sampled token's fp32 log-prob under the distribution it was
drawn from, after temperature and TRL's logits processors (top-k / top-p / min-p truncate and
renormalise, so a token's sampling log-prob exceeds its log-prob under the plain softmax at τ,
which the trainer computes; as with vLLM's processed log-probs, ρ then also corrects for the
truncation).

Tool turns: TRL's tool loop samples each post-tool continuation with `_generate_single_turn`
and concatenates its log-probs to the first turn's. The first turn of a `_generate` call
decides whether the call feeds log-probs; a later turn that our loop did not serve then returns
NaN log-probs, which TRL treats as vLLM's missing ones (δ = 0, left out of the metrics).

VESPO with a sequence_* mode, which TRL refuses for vLLM, gets no correction from our
log-probs (one logged line at construction).
"""

from __future__ import annotations

import contextlib

TOKEN_MODES = ("token_truncate", "token_mask")


class _Gate:
    """TRL's vLLM correction test, `use_vllm and vllm_importance_sampling_correction`, read as
    True on one trainer between `open` and `close`."""

    def __init__(self, trainer):
        self._trainer = trainer
        self._saved: tuple[bool, bool] | None = None

    def open(self) -> None:
        t = self._trainer
        if self._saved is None and not t.use_vllm:
            self._saved = (t.use_vllm, t.vllm_importance_sampling_correction)
            t.use_vllm = t.vllm_importance_sampling_correction = True

    def close(self) -> None:
        if self._saved is not None:
            t = self._trainer
            t.use_vllm, t.vllm_importance_sampling_correction = self._saved
            self._saved = None


class SamplerCorrection:
    """One GRPO trainer's feed of sampler log-probs (module docstring)."""

    def __init__(self, trainer, *, enabled: bool):
        if enabled and trainer.loss_type == "vespo" and (
                trainer.vllm_importance_sampling_mode not in TOKEN_MODES):
            trainer._lce_logger.warning(
                "grpo_lce: the decode loop's log-probs are not fed to TRL's importance-sampling "
                "correction (VESPO needs vllm_importance_sampling_mode in "
                f"{TOKEN_MODES}, got {trainer.vllm_importance_sampling_mode!r}).")
            enabled = False
        self.enabled = enabled
        self._gate = _Gate(trainer)
        self._fed: bool | None = None  # this call feeds log-probs; None before its first turn
        self._scoring = False

    def start_call(self) -> None:
        self._fed = None

    def logprobs(self, sample) -> list[list[float]] | None:
        """What `_generate_single_turn` returns as log-probs for a sample our samplers served."""
        if self._fed is None:
            self._fed = self.enabled and sample.logprobs is not None
        if not self._fed:
            return None
        if sample.logprobs is None:  # a later turn served by FastSampler
            return [[float("nan")] * len(ids) for ids in sample.token_ids]
        return sample.logprobs

    def fallback_logprobs(self, completion_ids, logprobs):
        """The same for a turn TRL's own method served (its `logprobs`: vLLM's, or None)."""
        if self._fed is None:
            self._fed = False
        if self._fed:
            return [[float("nan")] * len(ids) for ids in completion_ids]
        return logprobs

    def end_call(self) -> None:
        fed, self._fed = self._fed, None
        if fed and self._scoring:
            self._gate.open()

    @contextlib.contextmanager
    def scoring(self):
        """Around `_generate_and_score_completions`: the gate opens at `end_call` when this
        call fed log-probs, and closes when scoring ends."""
        self._scoring = True
        try:
            yield
        finally:
            self._scoring = False
            self._gate.close()

    @contextlib.contextmanager
    def loss(self, inputs):
        """Around `_compute_loss`: the gate is open when the inputs carry our ratio ρ."""
        trainer = self._gate._trainer
        if trainer.use_vllm or "importance_sampling_ratio" not in inputs:
            yield
            return
        self._gate.open()
        try:
            yield
        finally:
            self._gate.close()
