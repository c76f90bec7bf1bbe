"""The tiny fp32 Llama the trainer tests share (offline, from trainers.tiny)."""

import torch
from peft import LoraConfig, get_peft_model

from trainers.tiny import build_tiny_llama


def lora_tiny_llama(tok, *, tied=True, peft=True, seed=0):
    """Tiny fp32 Llama; with `peft`, a LoRA adapter on every linear layer (not lm_head) whose
    B matrices are random, so the adapter matters and the adapter-disabled reference differs."""
    model = build_tiny_llama(tok, hidden_size=64, num_layers=2, tie_word_embeddings=tied, seed=seed)
    if not peft:
        return model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0.0, 0.05)
    return model
