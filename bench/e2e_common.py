"""Pieces of bench/e2e.py that run inside a worker process: model shapes, building and
loading the random models, the synthetic batches, one timed + memory-measured call.

Everything here imports torch / transformers lazily or is plain Python, so the driver (which must
not touch CUDA) can import the constants.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import tempfile
import time

from bench.common import free_memory as free  # noqa: F401 - the workers' name for it
from trainers.config import checkpointing_kwargs as checkpointing_kw  # noqa: F401

GIB = 2**30
PROMPT_LEN = 64  # GRPO prompt tokens per sequence (all valid, no left padding)

# name -> LlamaConfig keywords. Random init; pad/bos/eos ids match trainers.tiny.build_tokenizer.
MODELS = {
    "1b": dict(  # Llama-3.2-1B shape
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
    ),
    "8b": dict(  # Llama-3.1-8B shape
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    ),
}
TINY_KW = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


# --------------------------------------------------------------------------- models


def model_dir(name: str, cache: str, seed: int = 0) -> str:
    """Directory holding model `name` (built on first use): bf16 safetensors + tokenizer.
    `seed` != 0: another random init of the same shape (a distillation teacher), in its own
    directory."""
    if name == "tiny":
        from trainers.tiny import tiny_model_dir

        return tiny_model_dir(**TINY_KW, **({"seed": seed} if seed else {}))
    path = os.path.join(cache, f"llama-{name}-shape" + (f"-seed{seed}" if seed else ""))
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainers.tiny import build_tokenizer

    config = LlamaConfig(
        **MODELS[name], max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache, prefix=".build-")
    torch.manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # Random init on the GPU straight in bf16: seconds, and 16 GB instead of 32 for the 8B shape.
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    gcfg = model.generation_config
    gcfg.pad_token_id, gcfg.bos_token_id, gcfg.eos_token_id = 0, 1, 2
    model.save_pretrained(tmp)
    build_tokenizer().save_pretrained(tmp)
    del model
    free()
    os.rename(tmp, path)  # atomic: a half-written model is never loaded
    return path


def load_model(path: str, *, device: str, quantize: bool, dtype=None, attn: str = "sdpa",
               gpu: int = 0):
    """4-bit NF4 (double quant, bf16 compute) on CUDA when `quantize`, else `dtype` weights;
    on CUDA on the GPU of index `gpu`."""
    import torch
    from transformers import AutoModelForCausalLM

    kw: dict = {"attn_implementation": attn}
    if quantize:
        from trainers.config import nf4_config

        kw["quantization_config"] = nf4_config()
        kw["dtype"] = torch.bfloat16
        kw["device_map"] = {"": gpu}
    else:
        kw["dtype"] = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
        kw["device_map"] = {"": gpu} if device == "cuda" else None
    return AutoModelForCausalLM.from_pretrained(path, **kw)


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")


def prepare_for_direct_calls(tr, checkpointing: bool) -> None:
    """What Trainer.train() does before the first step, for compute_loss called directly."""
    if checkpointing:
        tr.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1


def trainable_params(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def optimizer_state_bytes(model) -> int:
    """AdamW's exp_avg + exp_avg_sq, in the dtype of each trainable parameter."""
    return sum(2 * p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


# --------------------------------------------------------------------------- batches


def grpo_batch(G: int, L: int, V: int, device: str, seed: int = 0):
    """ids (G, P+L), mask: P prompt tokens, then completion i of length ⌈L·(i+1)/G⌉ (shuffled),
    right-padded to L: mean fill (G+1)/(2G), 56 % at G=8, as a length-capped sampler leaves it."""
    import torch

    g = torch.Generator().manual_seed(seed)
    P = PROMPT_LEN
    ids = torch.randint(3, V, (G, P + L), generator=g)  # 0, 1, 2 are pad / bos / eos
    lens = torch.tensor([-(-L * (i + 1) // G) for i in range(G)])[torch.randperm(G, generator=g)]
    pos = torch.arange(L)
    mask = torch.cat([torch.ones(G, P, dtype=torch.long), (pos[None] < lens[:, None]).long()], 1)
    ids[mask == 0] = 0
    return ids.to(device), mask.to(device)


def sft_batch(B: int, T: int, V: int, device: str, seed: int = 0) -> dict:
    """B full sequences of T tokens, every token a label (as packed SFT data is)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def copy_task_ids(n: int, T: int, V: int, seed: int = 0) -> list[list[int]]:
    """n pre-tokenized SFT rows of length T: a random block of T/4 tokens repeated, so a model can
    learn to copy and the loss falls below log V."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        block = [rng.randrange(3, V) for _ in range(max(1, T // 4))]
        rows.append((block * 4)[:T])
    return rows


def ids_hash(rows) -> str:
    h = hashlib.sha1()
    for r in rows:
        h.update(",".join(map(str, list(r))).encode())
        h.update(b";")
    return h.hexdigest()[:12]


# --------------------------------------------------------------------------- measuring


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def measured_call(fn, device: str):
    """(fn(), ms, peak bytes above the level at the call, peak bytes in all) for one call."""
    import torch

    cuda = device == "cuda"
    free()
    if cuda:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    if not cuda:
        return out, ms, None, None
    peak = torch.cuda.max_memory_allocated()
    return out, ms, peak - base, peak


def summarize(samples: list[tuple[float, int | None, int | None]]) -> dict:
    """Median ms (20/80 % spread) and the largest peaks over the timed calls of one phase."""
    ms = sorted(s[0] for s in samples)
    q = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else ms * 9
    extra = [s[1] for s in samples if s[1] is not None]
    total = [s[2] for s in samples if s[2] is not None]
    return {
        "ms": statistics.median(ms), "p20": q[1], "p80": q[7], "reps": len(ms),
        "extra_bytes": max(extra) if extra else None, "total_bytes": max(total) if total else None,
    }
