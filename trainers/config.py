"""Configs: `GRPOConfig` (TRL 1.16's plus the options of `trainers.GRPOTrainer`), and the two
transformers settings the scripts and benchmarks build the same way: the QLoRA base
(`nf4_config`) and the activation-checkpointing switch (`checkpointing_kwargs`).

`GRPOConfig`'s extra fields are plain dataclass fields, so YAML files and `TrlParser` /
`HfArgumentParser` command lines set them like any TRL option:

    --packing auto|true|false   --max_packed_tokens 16384   --fast_generation true|false
    --sampler auto|loop|compiled|trl   --sampler_importance_sampling_correction true|false

`trainers.GRPOTrainer` also accepts a stock `trl.GRPOConfig` (the options then take their
defaults) and the same options as constructor keywords, which win over the config. The trainer
reads them at construction; later, set `trainer.packing` / `trainer.max_packed_tokens` (checked
on set, `trainers.base`), not the config's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trl

PACKING_CHOICES = ("auto", "true", "false")
SAMPLER_CHOICES = ("auto", "loop", "compiled", "trl")  # trainers.sampling.serve's order


def normalize_packing(value, name: str = "packing") -> bool | str:
    """True, False or "auto" from a bool or one of "auto" / "true" / "false" (any case)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in PACKING_CHOICES:
        v = value.lower()
        return "auto" if v == "auto" else v == "true"
    raise ValueError(f"{name} must be True, False or 'auto', got {value!r}")


def check_max_packed_tokens(value, name: str = "max_packed_tokens") -> None:
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool)
                                  and value > 0):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def checked_sampler(value, name: str = "sampler") -> str:
    """`value` if it is one of SAMPLER_CHOICES, else a ValueError naming it."""
    if value not in SAMPLER_CHOICES:
        raise ValueError(f"{name} must be one of {SAMPLER_CHOICES}, got {value!r}")
    return value


def checked_bool(value, name: str) -> bool:
    """`value` if it is True or False, else a ValueError naming it."""
    if not isinstance(value, bool):
        # a ValueError as for every bad option value (TRL's and argparse's)
        raise ValueError(f"{name} must be True or False, got {value!r}")  # noqa: TRY004
    return value


def check_sampler_options(fast_generation, sampler) -> None:
    """`fast_generation` a bool, `sampler` one of SAMPLER_CHOICES, and not contradicting each
    other: fast_generation=False samples with TRL's generate, which only "auto" and "trl"
    allow."""
    checked_bool(fast_generation, "fast_generation")
    checked_sampler(sampler)
    if not fast_generation and sampler not in ("auto", "trl"):
        raise ValueError(f"fast_generation=False samples with TRL's generate, but "
                         f"sampler={sampler!r} asks for a fast sampler; set one of them")


@dataclass
class GRPOConfig(trl.GRPOConfig):
    """`trl.GRPOConfig` with the options of `trainers.GRPOTrainer` (module docstring)."""

    packing: str = field(
        default="auto",
        metadata={"help": "Padding-free log-prob passes: 'auto' (pack when the attention "
                          "implementation keeps packed rows apart without a dense mask), 'true' "
                          "or 'false'.", "choices": list(PACKING_CHOICES)},
    )
    max_packed_tokens: int | None = field(
        default=None,
        metadata={"help": "Tokens per packed forward; default: TRL's chunk, batch_size * length."},
    )
    fast_generation: bool = field(
        default=True,
        metadata={"help": "On CUDA, sample with our own samplers (`sampler`); False: TRL's "
                          "generate."},
    )
    sampler: str = field(
        default="auto",
        metadata={"help": "Which sampler serves on-policy generation (trainers.sampling.serve): "
                          "'auto' (our decode loop, then the compiled FastSampler, then TRL's "
                          "generate, each where the one before cannot serve), 'loop', "
                          "'compiled' or 'trl'.", "choices": list(SAMPLER_CHOICES)},
    )
    sampler_importance_sampling_correction: bool = field(
        default=True,
        metadata={"help": "When our decode loop served a generation, feed its exact sampling "
                          "log-probs to TRL's importance-sampling correction and its "
                          "sampling/* metrics, as TRL does for vLLM (vllm_importance_sampling_"
                          "mode, _clip_min and _clip_max apply). Default True, TRL's default "
                          "for vLLM."},
    )

    def __post_init__(self):
        super().__post_init__()
        self.packing = normalize_packing(self.packing)
        check_max_packed_tokens(self.max_packed_tokens)
        check_sampler_options(self.fast_generation, self.sampler)
        checked_bool(self.sampler_importance_sampling_correction,
                     "sampler_importance_sampling_correction")


def nf4_config():
    """The QLoRA base: bitsandbytes 4-bit NF4 with double quantization and bf16 compute."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def checkpointing_kwargs(enabled: bool) -> dict:
    """The TrainingArguments keyword that turns activation checkpointing on or off: its name is
    `activation_checkpointing` in newer transformers, `gradient_checkpointing` before."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    key = "activation_checkpointing" if "activation_checkpointing" in names else (
        "gradient_checkpointing")
    return {key: enabled}
