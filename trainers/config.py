"""`GRPOConfig`: TRL 1.16's `GRPOConfig` plus the options of `trainers.GRPOTrainer`.

The fields are plain dataclass fields, so YAML files and `TrlParser` / `HfArgumentParser`
command lines set them like any TRL option:

    --packing auto|true|false   --max_packed_tokens 16384   --fast_generation true|false

`trainers.GRPOTrainer` also accepts a stock `trl.GRPOConfig` (the options then take their
defaults) and the same options as constructor keywords, which win over the config.
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
