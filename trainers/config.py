"""Configs: `GRPOConfig` (TRL 1.16's plus the options of `trainers.GRPOTrainer`), and the two
transformers settings the scripts and benchmarks build the same way: the QLoRA base
(`nf4_config`) and the activation-checkpointing switch (`checkpointing_kwargs`).

`GRPOConfig`'s extra fields are plain dataclass fields, so YAML files and `TrlParser` /
`HfArgumentParser` command lines set them like any TRL option:

    --packing auto|true|false   --max_packed_tokens 16384   --fast_generation true|false

`trainers.GRPOTrainer` also accepts a stock `trl.GRPOConfig` (the options then take their
defaults) and the same options as constructor keywords, which win over the config. The trainer
reads them at construction; later, set `trainer.packing` / `trainer.max_packed_tokens` (checked
on set, `trainers.base`), not the config's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trl

PACKING_CHOICES = ("auto", "true", "false")


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
        metadata={"help": "On CUDA, sample with a static KV cache and a compiled decode step "
                          "(trainers.generation); falls back to TRL's generate where that "
                          "cannot run."},
    )

    def __post_init__(self):
        super().__post_init__()
        self.packing = normalize_packing(self.packing)
        check_max_packed_tokens(self.max_packed_tokens)


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
