"""Drop-in TRL trainers whose LM head runs through `grpo_lce` (no logits are built).

    from trainers import GRPOTrainer, SFTTrainer    # instead of: from trl import ...
    from grpo_lce_trainers import GRPOTrainer       # the same, when a trainers/ of your own
                                                    # would shadow this package's name

Same constructors, configs, datasets, reward functions, callbacks, PEFT and quantization
configs as TRL 1.16.x (checked at construction). `trainers.grpo` and `trainers.sft` say what is
overridden, what falls back to TRL's own head and what is refused. `trainers.GRPOConfig` is
`trl.GRPOConfig` plus the GRPO trainer's own options (packing, fast generation), for YAML and
`TrlParser` workflows; a stock `trl.GRPOConfig` works too.
"""

from ._version import SUPPORTED_TRL
from .config import GRPOConfig
from .grpo import GRPOTrainer
from .sft import SFTTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "SFTTrainer", "SUPPORTED_TRL"]
