"""The trainer side of fast on-policy sampling, written once for `trainers.GRPOTrainer`,
`trainers.RLOOTrainer` and `trainers.DistillationTrainer`.

TRL 1.16's three on-policy trainers sample through the same two methods:

    _generate(prompts)                    tokenize, sample, decode, completion-length metrics
      -> _generate_single_turn(prompt_ids, images, multimodal_fields, ...)
             vLLM | transformers continuous batching | model.generate on a left-padded batch

(GRPO's and distillation's tool loops call `_generate_single_turn` again per tool turn.)
`_generate_single_turn`'s signature and return value differ by trainer, so each trainer
overrides it in a few lines: `sample = self._lce_sample(prompt_ids, images, multimodal_fields)`,
its completions if not None, else TRL's method. `_lce_sample` pads the prompts as TRL's regular
path does (left, `pad_to_multiple_of`), unwraps the model as TRL does (DeepSpeed gather,
gradient checkpointing off, TRL's generation kwargs on the model's generation config), and asks
`trainers.sampling.serve.Samplers` for a sample with TRL's own generation config. It returns
None, leaving the call to TRL, for vLLM, continuous batching, images or multimodal fields, a
vision-language model, or when no fast sampler serves the call.

`_generate` is timed: `timing/generation_s` (sampling, tool turns included) and the
`fast_generation/*` metrics of `Samplers.metrics` are appended to TRL's metrics.

Options, as constructor keywords (which win) or fields of the trainer's config
(`trainers.GRPOConfig` has both; with a stock TRL config they take their defaults):

    fast_generation: True (default) or False (TRL's generate for every call)
    sampler: "auto" (default), "loop", "compiled" or "trl" (`trainers.sampling.serve`)

both also settable later as attributes (`trainer.sampler = "compiled"`). FSDP and DeepSpeed
turn the fast samplers off at construction, with one logged line: they gather the parameters
into new storage for every generate call, which captured graphs cannot follow.
"""

from __future__ import annotations

import time

import torch
from trl.extras.profiling import profiling_context
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import pad

from ..base import _Checked
from ..config import check_sampler_options, checked_bool, checked_sampler
from .serve import Sample, Samplers


class OnPolicySamplingMixin:
    """Mixed in before the other mixins of an on-policy trainer (module docstring)."""

    # each checked on every set (the pair at construction only: fast_generation=False set later
    # turns the fast samplers off whatever `sampler` says)
    sampler = _Checked(checked_sampler)
    fast_generation = _Checked(checked_bool)

    def __init__(self, *args, fast_generation: bool | None = None, sampler: str | None = None,
                 **kwargs):
        if fast_generation is not None:
            checked_bool(fast_generation, "fast_generation")
        if sampler is not None:
            checked_sampler(sampler)
        super().__init__(*args, **kwargs)
        self.fast_generation = (fast_generation if fast_generation is not None
                                else getattr(self.args, "fast_generation", True))
        self.sampler = sampler if sampler is not None else getattr(self.args, "sampler", "auto")
        check_sampler_options(self.fast_generation, self.sampler)
        self._lce_samplers = Samplers(self.sampler)
        if self._lce_fast_sampling_on() and (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            self._lce_samplers.disable("FSDP / DeepSpeed shard the parameters")

    # The compiled sampler as `trainer._lce_sampler` (tests and benchmarks swap it).
    @property
    def _lce_sampler(self):
        return self._lce_samplers.compiled

    @_lce_sampler.setter
    def _lce_sampler(self, sampler):
        self._lce_samplers.compiled = sampler

    def _lce_fast_sampling_on(self) -> bool:
        return self.fast_generation and self.sampler != "trl"

    def _generate(self, prompts: list):
        """TRL's `_generate`, timed (module docstring)."""
        t0 = time.perf_counter()
        out = super()._generate(prompts)  # returns token lists: the device work is done
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["timing/generation_s"].append(time.perf_counter() - t0)
        if self._lce_fast_sampling_on():
            for name, value in self._lce_samplers.metrics().items():
                self._metrics[mode][name].append(value)
        return out

    def _lce_sampling_applies(self, images, multimodal_fields) -> bool:
        return (self._lce_fast_sampling_on() and not self.use_vllm
                and not getattr(self, "use_transformers_continuous_batching", False)
                and images is None and not multimodal_fields
                and not getattr(self, "_is_vlm", False))

    def _lce_sample(self, prompt_ids: list[list[int]], images, multimodal_fields
                    ) -> Sample | None:
        """One call of TRL's regular generation path, served by our samplers; None: TRL's."""
        if not self._lce_sampling_applies(images, multimodal_fields):
            return None
        # the packing decision may switch the attention implementation a captured decode step
        # reads: make it before the first capture (`FusedHeadMixin._lce_settle_attention`)
        self._lce_settle_attention(self.model)
        self._lce_samplers.choice = self.sampler
        device = self.accelerator.device
        rows = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(rows, padding_value=self._tokenizer.pad_token_id, padding_side="left",
                        pad_to_multiple_of=self.pad_to_multiple_of).to(device)
        attention_mask = pad([torch.ones_like(r) for r in rows], padding_value=0,
                             padding_side="left",
                             pad_to_multiple_of=self.pad_to_multiple_of).to(device)
        with (
            profiling_context(self, "grpo_lce.sample"),
            unwrap_model_for_generation(
                self.model_wrapped, self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=self.generation_kwargs,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            return self._lce_samplers.serve(unwrapped_model, input_ids, attention_mask,
                                            self.generation_config,
                                            eos_token_ids=self.eos_token_ids)
