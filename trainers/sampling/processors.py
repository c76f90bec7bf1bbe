"""Graph-safe logits processing and sampling: static shapes, no host read.

The processing transformers' `generate` applies for the options TRL sets, in its order, on the
fp32 logits z (B, V):

    repetition penalty ρ (always, also greedy): for every token id seen in the row (its prompt
        without padding, and its completion so far) z_j <- z_j / ρ if z_j > 0 else z_j · ρ
    then, when sampling:
    temperature τ:  z <- z / τ
    top-k:  keep the k largest (ties at the k-th value kept), others -> -inf
    top-p:  sort ascending, drop the tokens whose cumulative probability is <= 1 - p (the
            largest always kept)
    min-p:  drop the tokens with probability < min_p · max probability (the largest kept)

Sampling draws y ~ softmax(z') from the processed z' by the exponential race
y = argmax_j softmax(z')_j / E_j, E_j ~ Exp(1) i.i.d. (the first arrival of competing Poisson
clocks of rates p_j is j with probability p_j); greedy takes argmax z'. Both are capturable with
the default CUDA generator.

Returned log-prob: log_softmax(z')_y in fp32, the log-probability under the distribution y was
drawn from. Truncation sets the dropped logits to -inf, so under top-k / top-p / min-p the
log-prob is under the renormalised truncated distribution (log p_y - log Σ_kept p_j, >= log p_y);
temperature is included (z / τ). Greedy returns the same quantity for the argmax.
"""

from __future__ import annotations

import dataclasses

import torch

from .kernels.race import race_sample

# GenerationConfig fields that change which token is drawn or how it is scored, with the value
# that turns each off; any other value is a configuration this module does not compute.
NEUTRAL = {
    "num_beams": (1, None),
    "num_return_sequences": (1, None),
    "min_length": (0, None),
    "min_new_tokens": (0, None),
    "no_repeat_ngram_size": (0, None),
    "encoder_no_repeat_ngram_size": (0, None),
    "encoder_repetition_penalty": (1.0, None),
    "bad_words_ids": (None,),
    "sequence_bias": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "typical_p": (1.0, None),
    "epsilon_cutoff": (0.0, None),
    "eta_cutoff": (0.0, None),
    "top_h": (None,),
    "exponential_decay_length_penalty": (None,),
    "guidance_scale": (1.0, None),
    "watermarking_config": (None,),
    "stop_strings": (None,),
    "max_time": (None,),
    "penalty_alpha": (None,),
    "dola_layers": (None,),
    "prompt_lookup_num_tokens": (None,),
    "assistant_early_exit": (None,),
    "remove_invalid_values": (False, None),
    "renormalize_logits": (False, None),
    "low_memory": (False, None),
    "token_healing": (False, None),
    "prefill_chunk_size": (None,),
}


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    do_sample: bool
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0


def spec_from_config(config, vocab_size: int) -> tuple[SamplingSpec | None, str | None]:
    """(spec, None), or (None, why this resolved GenerationConfig is not covered)."""
    for name, neutral in NEUTRAL.items():
        value = getattr(config, name, None)
        if value not in neutral:
            return None, f"generation_config.{name}={value!r}"
    if config.do_sample not in (True, False):
        return None, f"generation_config.do_sample={config.do_sample!r}"
    rho = config.repetition_penalty if config.repetition_penalty is not None else 1.0
    if not rho > 0:
        return None, f"generation_config.repetition_penalty={rho!r}"
    if not config.do_sample:
        return SamplingSpec(False, repetition_penalty=float(rho)), None
    tau = config.temperature if config.temperature is not None else 1.0
    if not tau > 0:
        return None, f"generation_config.temperature={tau!r} with do_sample=True"
    k = config.top_k or 0
    top_p = config.top_p if config.top_p is not None else 1.0
    return SamplingSpec(True, float(tau), min(int(k), vocab_size), float(top_p),
                        None if config.min_p is None else float(config.min_p), float(rho)), None


def process(z: torch.Tensor, spec: SamplingSpec, seen: torch.Tensor | None) -> torch.Tensor:
    """The processed logits z' (B, V) fp32 of the module docstring; `seen` (B, V) bool marks the
    ids the repetition penalty applies to (None when it is off)."""
    if spec.repetition_penalty != 1.0:
        rho = spec.repetition_penalty
        z = torch.where(seen, torch.where(z > 0, z / rho, z * rho), z)
    if not spec.do_sample:
        return z
    if spec.temperature != 1.0:
        z = z / spec.temperature
    if spec.top_k:
        kth = torch.topk(z, spec.top_k, dim=-1).values[:, -1:]  # (B, 1)
        z = z.masked_fill(z < kth, float("-inf"))
    if spec.top_p < 1.0:
        zs, order = torch.sort(z, dim=-1)  # ascending
        cum = zs.softmax(-1).cumsum(-1)
        drop = cum <= 1 - spec.top_p
        drop[:, -1] = False
        z = z.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    if spec.min_p is not None:
        p = z.softmax(-1)
        drop = p < spec.min_p * p.amax(-1, keepdim=True)
        drop.scatter_(1, p.argmax(-1, keepdim=True), False)
        z = z.masked_fill(drop, float("-inf"))
    return z


def sample(z: torch.Tensor, spec: SamplingSpec, *,
           fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(y (B,) int64, log_softmax(z')_y (B,) fp32) from processed logits z' (B, V) fp32.
    `fused`: the reductions by `kernels.race.race_sample` (the same draws; module docstring
    there for how its sums differ)."""
    if fused:
        return race_sample(z, torch.empty_like(z).exponential_() if spec.do_sample else None)
    logp = torch.log_softmax(z, dim=-1)
    if spec.do_sample:
        # argmax_j p_j / E_j = argmax_j log p_j - log E_j; E is clamped away from 0 so a dropped
        # token (log p = -inf) can never win through log 0 = -inf
        race = torch.empty_like(logp).exponential_().clamp_min_(1e-30)
        y = (logp - race.log()).argmax(-1)
    else:
        y = z.argmax(-1)
    return y, logp.gather(1, y[:, None])[:, 0]
