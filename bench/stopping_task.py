"""The task and the model of bench.stopping_model: a small Llama taught by SFT to end its
answers with EOS at varied lengths, with peaked next-token distributions.

The task (`ChainTask`): a random permutation of C chain tokens cut into chains of lengths
uniform in [min_len, max_len]. A prompt is BOS, 4-40 noise tokens, then one token of a chain;
the answer is the rest of that chain, then EOS. The next token depends only on the current one
(a bigram map a small model learns in a few hundred steps), answers end at every length from 1
to the longest chain, and a sampled answer that leaves its chain lands on another one and still
ends in EOS.

The model (`build_model`): `SHAPES["4l"]` is the Llama-3.2-1B shape with 4 layers (Llama-3
vocabulary 128256, H = 2048, GQA 32 / 8, tied head), "1b" all 16 layers, "tiny" a CPU toy;
trained in bf16 (`train_sft`: loss on the answer tokens through grpo_lce's
linear_cross_entropy, AdamW, warm-up then cosine), then held as a GRPO trainer holds it
(`sampling_model`: NF4 or bf16 base + LoRA r = 16, B = 0).
"""

from __future__ import annotations

import dataclasses
import math
import random
import time

import torch

from bench.e2e_common import MODELS

PAD, BOS, EOS = 0, 1, 2
SHAPES = {
    "4l": {**MODELS["1b"], "num_hidden_layers": 4},
    "1b": MODELS["1b"],
    "tiny": {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 256,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "tie_word_embeddings": True},
}

# =========================================================================== the task


@dataclasses.dataclass
class ChainTask:
    chains: list[list[int]]
    noise: tuple[int, int]  # noise token ids [lo, hi)

    @classmethod
    def make(cls, vocab: int, n_tokens: int, min_len: int, max_len: int, seed: int = 0):
        """Chains over ids [16, 16 + n_tokens), noise tokens above them."""
        rng = random.Random(seed)
        ids = list(range(16, 16 + n_tokens))
        rng.shuffle(ids)
        chains, i = [], 0
        while i < len(ids):
            n = rng.randint(min_len, max_len)
            if len(ids) - i - n < min_len:  # no chain shorter than min_len at the end
                n = len(ids) - i
            chains.append(ids[i:i + n])
            i += n
        lo = 16 + n_tokens
        return cls(chains, (lo, min(vocab, lo + 4096)))

    def example(self, rng: random.Random) -> tuple[list[int], list[int]]:
        """(prompt, answer): BOS, 4-40 noise tokens, one chain token; the chain's rest, EOS."""
        chain = rng.choice(self.chains)
        j = rng.randrange(len(chain) - 1) if len(chain) > 1 else 0
        noise = [rng.randrange(*self.noise) for _ in range(rng.randint(4, 40))]
        return [BOS, *noise, chain[j]], [*chain[j + 1:], EOS]


def left_padded(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), PAD, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    return ids.to(device), mask.to(device)


def trimmed(completions: torch.Tensor) -> list[list[int]]:
    from trainers.generation import trim_after_eos

    return trim_after_eos(completions, [EOS])


# =========================================================================== the model


def build_model(shape: str, device: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, rope_theta=500000.0,
                         rms_norm_eps=1e-5, bos_token_id=BOS, eos_token_id=EOS,
                         pad_token_id=PAD, attn_implementation="sdpa")
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    g = model.generation_config
    g.pad_token_id, g.bos_token_id, g.eos_token_id = PAD, BOS, EOS
    return model


def train_sft(model, task: ChainTask, *, steps: int, batch: int, lr: float, device: str,
              seed: int = 0, log_every: int = 25) -> list[dict]:
    """SFT on (prompt, answer) pairs, loss on the answer tokens; returns the loss curve."""
    from grpo_lce import linear_cross_entropy

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    weight = model.get_output_embeddings().weight
    curve, t0 = [], time.perf_counter()
    model.train()
    for step in range(steps):
        pairs = [task.example(rng) for _ in range(batch)]
        T = max(len(p) + len(a) for p, a in pairs)
        ids = torch.full((batch, T), PAD, dtype=torch.long)
        labels = torch.full((batch, T), -100, dtype=torch.long)
        for i, (p, a) in enumerate(pairs):
            seq = p + a
            ids[i, :len(seq)] = torch.tensor(seq)
            labels[i, len(p) - 1:len(seq) - 1] = torch.tensor(a)  # position t predicts t+1
        ids, labels = ids.to(device), labels.to(device)
        mask = (ids != PAD).long()
        h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, H)
        loss = linear_cross_entropy(h.flatten(0, 1), weight, labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == steps - 1:
            curve.append({"step": step, "loss": loss.item(),
                          "s": round(time.perf_counter() - t0, 2)})
            print(f"  sft step {step:4d}  loss {loss.item():.4f}", flush=True)
    model.eval()
    del opt
    return curve


def sampling_model(model, base: str, device: str, workdir: str):
    """The trained model as a GRPO trainer holds it: NF4 (or bf16) base + LoRA r = 16 on every
    linear layer, B = 0 (the adapter changes nothing yet, but runs)."""
    from peft import get_peft_model

    from bench.e2e_common import lora_config

    if base == "nf4" and device == "cuda":
        from transformers import AutoModelForCausalLM

        from trainers.config import nf4_config

        model.save_pretrained(workdir)
        model = AutoModelForCausalLM.from_pretrained(
            workdir, quantization_config=nf4_config(), dtype=torch.bfloat16,
            device_map={"": 0}, attn_implementation="sdpa")
    model = get_peft_model(model, lora_config())
    if device == "cuda":
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)  # TRL keeps QLoRA adapters in bf16
    model.eval()
    return model


def generation_config(new: int):
    from bench.generation import trl_generation_config

    return trl_generation_config(new, eos_token_id=[EOS], pad_token_id=PAD, bos_token_id=BOS)
