"""Our own on-policy sampler: the decode loop and its kernels.

`DecodeLoop.generate(model, input_ids, attention_mask, generation_config)` samples completions of
TRL's left-padded prompts with a functional forward of the model's own modules over a static KV
cache (`model_step`, `cache`), graph-safe logits processing and sampling (`processors`), and, on
CUDA, several decode steps captured as one CUDA graph (`loop`). It returns the completions and the
fp32 log-prob of every sampled token under the distribution it was drawn from, or None (the caller
then samples with `trainers.generation.FastSampler`).
"""

from .loop import Completions, DecodeLoop, LoopStats

__all__ = ["Completions", "DecodeLoop", "LoopStats"]
