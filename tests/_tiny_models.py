"""The tiny fp32 models the trainer tests share (offline: trainers.tiny's tokenizer and Llama,
and a Qwen2 built here the same way)."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from trainers import tiny
from trainers.tiny import build_tiny_llama


def build_tiny_qwen2(tok, *, hidden_size=64, num_layers=2, tie_word_embeddings=True, seed=0):
    """Randomly initialised fp32 Qwen2 (q/k/v projections with bias) over `tok`'s vocabulary,
    embeddings at std 0.25 like trainers.tiny's Llama (logits up to ~16 at H = 64)."""
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
        model.get_input_embeddings().weight.data.normal_(0.0, 0.25)
        if not tie_word_embeddings:
            model.get_output_embeddings().weight.data.normal_(0.0, 0.25)
    gc = model.generation_config
    gc.pad_token_id, gc.bos_token_id = tok.pad_token_id, tok.bos_token_id
    gc.eos_token_id = tok.eos_token_id
    return model


def with_lora(model, *, seed=0):
    """A LoRA adapter on every linear layer (not lm_head) whose B matrices are random, so the
    adapter matters and the adapter-disabled reference differs."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0.0, 0.05)
    return model


def lora_tiny_llama(tok, *, tied=True, peft=True, seed=0):
    """Tiny fp32 Llama; with `peft`, `with_lora`."""
    model = build_tiny_llama(tok, hidden_size=64, num_layers=2, tie_word_embeddings=tied, seed=seed)
    return with_lora(model, seed=seed) if peft else model


def lora_tiny_qwen2(tok, *, tied=True, peft=True, seed=0):
    """Tiny fp32 Qwen2; with `peft`, `with_lora`."""
    model = build_tiny_qwen2(tok, tie_word_embeddings=tied, seed=seed)
    return with_lora(model, seed=seed) if peft else model


def soft_head_model(tok, arch="llama", *, tied, peft, hidden=64, seed=0):
    """trainers.tiny's 2-layer Llama or Qwen2 with its head scaled down 4× (entropies of ~1-4
    nats, not the near one-hot rows of the raw tiny models, where every divergence saturates);
    with `peft`, `with_lora`. The distillation tests' student and teacher."""
    build = {"llama": tiny.build_tiny_llama, "qwen2": tiny.build_tiny_qwen2}[arch]
    model = build(tok, hidden_size=hidden, num_layers=2, tie_word_embeddings=tied, seed=seed)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.25)
    return with_lora(model, seed=seed) if peft else model


def tiny_model(tok, arch="llama", **kw):
    """`lora_tiny_llama` or `lora_tiny_qwen2` by name."""
    return {"llama": lora_tiny_llama, "qwen2": lora_tiny_qwen2}[arch](tok, **kw)


def add_head_bias(model, *, seed=0):
    """Give the (untied) LM head of `model` a random bias, as some models have (the forward
    adds it; every fused head must too)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = lm.get_output_embeddings()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 7)
        new = torch.nn.Linear(head.in_features, head.out_features, bias=True)
        new.weight.data.copy_(head.weight.data)
        new.bias.data.normal_(0.0, 0.5)
    new.weight.requires_grad_(head.weight.requires_grad)
    new.bias.requires_grad_(head.weight.requires_grad)
    lm.lm_head = new
    return model
