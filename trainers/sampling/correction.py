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
self.vllm_importance_sampling_correction`; TRL has no method that computes ρ on its own, and
the loss code is not reproduced here. So, when our decode loop served a call and the switch
`sampler_importance_sampling_correction` is on (default True, TRL's default for vLLM),
`_generate_single_turn` returns the loop's log-probs (TRL then pads them into
`sampling_per_token_logps`, as vLLM's), and the trainer's two instance attributes `use_vllm`
and `vllm_importance_sampling_correction` read True (`_Gate`: saved and restored, also on an
exception) where TRL then needs them:

- **ρ from TRL's old-policy pass**, where an optimizer step can fall between a generation and
  the losses on its samples (`gradient_accumulation_steps` not a multiple of
  `steps_per_generation · num_iterations`, so TRL runs that pass anyway): from the end of
  `_generate` to the end of that `_generate_and_score_completions`, and around a
  `_compute_loss` whose inputs carry ρ. After `_generate` TRL reads `use_vllm` only for the
  correction (the old-policy pass, ρ, the metrics, the outputs), and in `_compute_loss` only
  to apply ρ; sampling itself never runs with the gate open.
- **ρ from the loss's policy pass** otherwise (the default: one iteration per generation): TRL
  skips its old-policy pass, which would run only for ρ, as the loss's own policy pass
  computes the same log-probs with the same weights. The gate stays closed while scoring (TRL
  skips ρ and the metrics, and still returns `sampling_per_token_logps`). In `_compute_loss`
  the policy log-probs, detached, are the old ones: right after that pass (`policy_logprobs`)
  ρ is computed by the formulas above (`sampler_ratio`) into the loss's inputs and the metrics
  are logged, once per loss micro-batch; the gate is open around the loss, which then applies
  ρ as it applies one from scoring. TRL's ratio to the old policy is exactly 1, as in TRL
  without vLLM. One forward pass less per generation batch.

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

Several processes (DDP): TRL gathers the correction's metrics across processes, a collective
that every process must enter, and each process's sampler is chosen on its own (a loop that
failed its first-call check on one rank's prompts serves there no more). So the first turn of
each call asks every process whether its own first turn feeds log-probs (`all_processes`, one
gather of a flag per generation call) and feeds them only where all do; otherwise no process
does, for that call (one logged line).
"""

from __future__ import annotations

import contextlib
import math

import torch
from trl.trainer.utils import nanmax, nanmin

TOKEN_MODES = ("token_truncate", "token_mask")
SEQUENCE_MODES = ("sequence_truncate", "sequence_mask")


def sampler_ratio(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
                  mode: str, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """ρ of the module docstring: (B, T) for the token_* modes, (B, 1) for sequence_*. A NaN
    sampling log-prob (a turn no sampler scored) contributes δ = 0."""
    delta = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode in SEQUENCE_MODES:
        delta = delta.sum(-1, keepdim=True)
    elif mode not in TOKEN_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of "
                         f"{TOKEN_MODES + SEQUENCE_MODES}, got {mode!r}")
    ratio = delta.exp()
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def all_processes(flag: bool, accelerator) -> bool:
    """Whether `flag` holds on every process of `accelerator` (a collective: every process must
    call it; a single process answers alone)."""
    if accelerator.num_processes == 1:
        return flag
    mine = torch.tensor([int(flag)], device=accelerator.device)
    return bool(accelerator.gather(mine).min().item())


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
        self._loss_inputs: dict | None = None  # a loss whose ρ waits for its policy pass
        self._disagreed_logged = False

    @property
    def _trainer(self):
        return self._gate._trainer

    def defers(self) -> bool:
        """True where TRL skips its old-policy pass: ρ then comes from the loss's policy pass
        (module docstring)."""
        t = self._trainer
        every = t.args.steps_per_generation * t.num_iterations
        return t.args.gradient_accumulation_steps % every == 0

    def start_call(self) -> None:
        self._fed = None

    def _decide(self, mine: bool) -> bool:
        """Whether this call feeds log-probs: `mine` (this process's first turn does) on every
        process (module docstring: several processes)."""
        t = self._trainer
        if not self.enabled or t.use_vllm:  # the same on every process: no collective
            return False
        fed = all_processes(mine, t.accelerator)
        if mine and not fed and not self._disagreed_logged:
            self._disagreed_logged = True
            t._lce_logger.warning(
                "grpo_lce: a generation's sampler log-probs are not fed to the importance-sampling "
                "correction: another process's decode loop did not serve it (no process feeds "
                "them for such a call).")
        return fed

    def logprobs(self, sample) -> list[list[float]] | None:
        """What `_generate_single_turn` returns as log-probs for a sample our samplers served."""
        if self._fed is None:
            self._fed = self._decide(sample.logprobs is not None)
        if not self._fed:
            return None
        if sample.logprobs is None:  # a later turn served by FastSampler
            return [[float("nan")] * len(ids) for ids in sample.token_ids]
        return sample.logprobs

    def fallback_logprobs(self, completion_ids, logprobs):
        """The same for a turn TRL's own method served (its `logprobs`: vLLM's, or None)."""
        if self._fed is None:
            self._fed = self._decide(False)
        if self._fed:
            return [[float("nan")] * len(ids) for ids in completion_ids]
        return logprobs

    def end_call(self) -> None:
        fed, self._fed = self._fed, None
        if fed and self._scoring and not self.defers():
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
    def loss(self, inputs: dict):
        """Around `_compute_loss`: the gate is open when the inputs carry our ratio ρ, or carry
        our sampling log-probs without ρ (a deferred ρ: `policy_logprobs` adds it to `inputs`,
        which must be the dict the loss reads)."""
        trainer = self._trainer
        has_ratio = "importance_sampling_ratio" in inputs
        if trainer.use_vllm or not (has_ratio or "sampling_per_token_logps" in inputs):
            yield
            return
        self._loss_inputs = None if has_ratio else inputs
        self._gate.open()
        try:
            yield
        finally:
            self._loss_inputs = None
            self._gate.close()

    def policy_logprobs(self, logps: torch.Tensor) -> None:
        """After the loss's policy pass: a deferred ρ from these log-probs (detached) as the
        old policy's, into the loss's inputs, and TRL's sampling/* metrics."""
        inputs, self._loss_inputs = self._loss_inputs, None
        if inputs is None:
            return
        t = self._trainer
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        old, sampling = logps.detach(), inputs["sampling_per_token_logps"]
        ratio = sampler_ratio(old, sampling, mask, t.vllm_importance_sampling_mode,
                              t.vllm_importance_sampling_clip_min,
                              t.vllm_importance_sampling_clip_max)
        inputs["importance_sampling_ratio"] = ratio
        self._log_metrics(old, sampling, mask.bool(), ratio)

    def _log_metrics(self, old, sampling, valid, ratio) -> None:
        """TRL's sampling/* metrics: |δ| over the valid tokens whose sampling log-prob is known,
        and ρ over the valid tokens (token_* modes) or the rows (sequence_* modes)."""
        t = self._trainer
        gather = t.accelerator.gather
        zero = torch.zeros((), device=old.device)
        delta = (old - sampling).abs()
        delta = delta[valid & ~delta.isnan()]
        flat = ratio.flatten() if t.vllm_importance_sampling_mode in SEQUENCE_MODES else ratio[valid]
        metrics = t._metrics["train" if t.model.training else "eval"]

        def stat(values, fn):
            return fn(values) if values.numel() else zero

        metrics["sampling/sampling_logp_difference/mean"].append(
            gather(stat(delta, torch.mean)).mean().item())
        metrics["sampling/sampling_logp_difference/max"].append(
            gather(stat(delta, torch.max)).max().item())
        metrics["sampling/importance_sampling_ratio/min"].append(
            nanmin(gather(stat(flat, torch.min))).item())
        metrics["sampling/importance_sampling_ratio/mean"].append(
            gather(stat(flat, torch.mean)).nanmean().item())
        metrics["sampling/importance_sampling_ratio/max"].append(
            nanmax(gather(stat(flat, torch.max))).item())
