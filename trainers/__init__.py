"""Drop-in TRL trainers whose LM head runs through `grpo_lce` (no logits are built).

    from trainers import GRPOTrainer, SFTTrainer    # instead of: from trl import ...

Same constructors, configs, datasets, reward functions, callbacks, PEFT and quantization
configs as TRL 1.16.x (checked at construction). `trainers.grpo` and `trainers.sft` say what is
overridden, what falls back to TRL's own head and what is refused. `trainers.GRPOConfig` is
`trl.GRPOConfig` plus the GRPO trainer's own options (packing, fast generation), for YAML and
`TrlParser` workflows; a stock `trl.GRPOConfig` works too.
"""

from trainers._version import SUPPORTED_TRL
from trainers.config import GRPOConfig
from trainers.grpo import GRPOTrainer
from trainers.sft import SFTTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "SFTTrainer", "SUPPORTED_TRL"]
