"""The train scripts' defaults, in one place: what each script sets for every model, and the
per-model presets on top.

Every name is a field of the script's dataclasses (TRL's `GRPOConfig` / `SFTConfig`, TRL's
`ModelConfig`, or the script's own arguments), so a preset is that field's default: a value
from `--config recipe.yaml` replaces it, a command-line flag replaces both. `--help` shows the
default for the `--model` given (the tiny model's without one), and each preset field's help
lists the three presets.

The model kinds: `tiny` (the offline Llama of the CPU demo, calibrated to show learning in about
a minute on 2 CPU cores), `smollm2` (SmolLM2-135M-Instruct on CPU, a visible gain in minutes),
`other` (any hub id or local path: a real model on a GPU).
"""

from __future__ import annotations

KINDS = ("tiny", "smollm2", "other")

# GRPO: field -> value per model kind.
GRPO_PRESETS = {
    "max_steps": {"tiny": 600, "smollm2": 40, "other": 600},
    "per_device_train_batch_size": {"tiny": 64, "smollm2": 16, "other": 64},
    "learning_rate": {"tiny": 3e-4, "smollm2": 2e-4, "other": 2e-5},
    "max_completion_length": {"tiny": 8, "smollm2": 16, "other": 256},
    "beta": {"tiny": 0.01, "smollm2": 0.0, "other": 0.01},
    "temperature": {"tiny": 1.0, "smollm2": 0.7, "other": 1.0},
    "reward": {"tiny": "arithmetic", "smollm2": "arithmetic,concise", "other": "arithmetic"},
    "max_operand": {"tiny": 9, "smollm2": 20, "other": 9},
    # tiny: a quarter of the 100 single-digit problems, held out of GRPO's training pool
    "eval_size": {"tiny": 25, "smollm2": 64, "other": 128},
    "eval_samples": {"tiny": 16, "smollm2": 4, "other": 4},
    # the warm start trains on the built-in task's completions; 0 with --dataset (see defaults)
    "sft_warmup_steps": {"tiny": 100, "smollm2": 0, "other": 0},
}

# SFT: field -> value per model kind. The tiny model learns from scratch at a high rate; a
# pretrained model's LoRA takes the usual 2e-4.
SFT_PRESETS = {
    "max_steps": {"tiny": 300, "smollm2": 40, "other": 300},
    "per_device_train_batch_size": {"tiny": 32, "smollm2": 8, "other": 8},
    "learning_rate": {"tiny": 3e-3, "smollm2": 2e-4, "other": 2e-4},
    "max_operand": {"tiny": 9, "smollm2": 20, "other": 9},
    "eval_size": {"tiny": 25, "smollm2": 64, "other": 128},
}

# Both scripts, every model: where they differ from TRL's dataclass defaults. 
COMMON = {
    "seed": 0,
    "logging_steps": 1,
    "save_strategy": "steps",
    "save_total_limit": 2,
    "dataloader_num_workers": 0,
    "disable_tqdm": True,  # the scripts' ProgressCallback draws the bar and the step lines
    "report_to": "none",
    # LoRA by default (--lora_r 0, or --use_peft false, trains the whole model)
    "use_peft": True,
    "lora_dropout": 0.0,
    "lora_target_modules": ["all-linear"],
    "use_bnb_nested_quant": True,  # the QLoRA base: NF4 with double quantization
}
# Defaults computed from the step count where the user set none (TRL's ratios would round
# 5 % of 600 up to 31, not 30): field -> (what --help says, the rule).
DERIVED = {
    "warmup_steps": ("max(1, max_steps // 20)", lambda max_steps: max(1, max_steps // 20)),
    "save_steps": ("max(1, max_steps // 4); with --resume the checkpoint's",
                   lambda max_steps: max(1, max_steps // 4)),
}
GRPO_COMMON = {**COMMON, "lr_scheduler_type": "constant_with_warmup", "num_generations": 8,
               "loss_type": "dapo"}
SFT_COMMON = {**COMMON, "lr_scheduler_type": "cosine"}


def model_kind(model: str) -> str:
    """'tiny', 'smollm2' or 'other' for a --model value."""
    return model if model in ("tiny", "smollm2") else "other"


def device_defaults(kind: str, cuda: bool) -> dict:
    """What the machine decides: bf16 and a 4-bit base with activation checkpointing for real
    models on CUDA; fp32 without checkpointing on CPU and for the two small built-in models."""
    real_on_gpu = cuda and kind == "other"
    return {"bf16": cuda, "use_cpu": not cuda, "dtype": "bfloat16" if cuda else "float32",
            "load_in_4bit": real_on_gpu, "fast_generation": cuda,
            # transformers' name, and its older one (TRL's configs default it to True)
            "activation_checkpointing": real_on_gpu, "gradient_checkpointing": real_on_gpu}


def defaults(script: str, kind: str, *, cuda: bool, dataset: bool) -> dict:
    """Every default the script sets for a --model of `kind`: {field: value}."""
    presets, common = (GRPO_PRESETS, GRPO_COMMON) if script == "grpo" else (SFT_PRESETS,
                                                                           SFT_COMMON)
    out = {**common, **device_defaults(kind, cuda), **dict.fromkeys(DERIVED)}
    out.update({name: values[kind] for name, values in presets.items()})
    if dataset and "sft_warmup_steps" in out:
        out["sft_warmup_steps"] = 0  # a user's dataset need not hold completions
    return out


def preset_help(script: str, name: str) -> str | None:
    """'tiny 600, smollm2 40, other 600' for a preset field, else None."""
    values = (GRPO_PRESETS if script == "grpo" else SFT_PRESETS).get(name)
    return ", ".join(f"{k} {values[k]}" for k in KINDS) if values else None


def markdown_table() -> str:
    """Both scripts' presets as the Markdown table the README shows."""
    rows = [f"| {script} | `{name}` | " + " | ".join(f"`{v[k]}`" for k in KINDS) + " |"
            for script, presets in (("GRPO", GRPO_PRESETS), ("SFT", SFT_PRESETS))
            for name, v in presets.items()]
    return "\n".join(["| script | field | " + " | ".join(f"`{k}`" for k in KINDS) + " |",
                      "|---|---|---|---|---|", *rows])
