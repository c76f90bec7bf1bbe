"""Drop-in TRL trainers whose LM head runs through `grpo_lce` (no logits are built).

    from trainers import GRPOTrainer, DPOTrainer    # instead of: from trl import ...
    from grpo_lce_trainers import GRPOTrainer       # the same, when a trainers/ of your own
                                                    # would shadow this package's name

Same constructors, configs, datasets, reward functions, callbacks, PEFT and quantization
configs as TRL 1.16.x (checked at construction): GRPOTrainer, SFTTrainer, RLOOTrainer,
DPOTrainer, KTOTrainer and DistillationTrainer. Each module (`trainers.grpo`, `.sft`, `.rloo`,
`.dpo`, `.kto`, `.distillation`) says what is overridden, what falls back to TRL's own head and what is refused. `trainers.GRPOConfig` is
`trl.GRPOConfig` plus the GRPO trainer's own options (packing, fast generation), for YAML and
`TrlParser` workflows; a stock `trl.GRPOConfig` works too.

Importing the package imports none of its modules: each name below loads its own module on
first access (PEP 562), so `import trainers.config` or `import trainers.tiny` stays as cheap as
that module, without the trainers, TRL's trainer classes or PEFT.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# exported name -> the module (relative: the package may be loaded as `grpo_lce_trainers`)
_EXPORTS = {
    "DistillationTrainer": "distillation",
    "DPOTrainer": "dpo",
    "GRPOConfig": "config",
    "GRPOTrainer": "grpo",
    "KTOTrainer": "kto",
    "RLOOTrainer": "rloo",
    "SFTTrainer": "sft",
    "SUPPORTED_TRL": "_version",
}

__all__ = [
    "SUPPORTED_TRL", "DPOTrainer", "DistillationTrainer", "GRPOConfig", "GRPOTrainer",
    "KTOTrainer", "RLOOTrainer", "SFTTrainer",
]

if TYPE_CHECKING:
    from ._version import SUPPORTED_TRL
    from .config import GRPOConfig
    from .distillation import DistillationTrainer
    from .dpo import DPOTrainer
    from .grpo import GRPOTrainer
    from .kto import KTOTrainer
    from .rloo import RLOOTrainer
    from .sft import SFTTrainer


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
