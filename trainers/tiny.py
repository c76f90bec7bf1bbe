"""Tiny offline models for tests and the default script runs: no hub, no network.

`build_tokenizer()` is a character-level tokenizer (one token per character of printable ASCII,
plus special tokens and chat-role markers) with a small Jinja chat template;
`build_tiny_llama()` a randomly initialised fp32 `LlamaForCausalLM` over that vocabulary
(`build_tiny_qwen2()` the same as a `Qwen2ForCausalLM`: q/k/v biases, another architecture);
`tiny_model_dir()` saves both once under `~/.cache/grpo_lce/` and returns the path, so code that
expects a hub id or a local path (`from_pretrained`) can use it.

    from trainers.tiny import build_tokenizer, build_tiny_llama, tiny_model_dir
    tok = build_tokenizer(); model = build_tiny_llama(tok, hidden_size=64)
    path = tiny_model_dir()          # ~/.cache/grpo_lce/tiny-llama-<hash>
"""

from __future__ import annotations

import hashlib
import json
import os
import string
import tempfile

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

_VERSION = 2  # bump when the builders change, so cached directories are rebuilt
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ROLES = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
# Assistant turns end with EOS so a model trained on them learns to stop; the `generation`
# markers let TRL's assistant-only loss find the assistant tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: printable ASCII (digits, letters, operators, punctuation,
    whitespace), specials <pad> <bos> <eos> <unk> and the chat markers in `ROLES`."""
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    specials = [PAD, BOS, EOS, UNK, *ROLES]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # One pre-token per character (`[\s\S]` so newlines split too); Fuse joins them back
    # without the spaces WordLevel would otherwise insert.
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=list(ROLES),
        model_max_length=512,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _tiny_config(config_cls, tokenizer, *, hidden_size, num_layers, num_heads, num_kv_heads,
                 intermediate_size, tie_word_embeddings, **extra):
    """A small decoder config over the tokenizer's vocabulary and special-token ids."""
    return config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )


def _tiny_model(model_cls, config, tokenizer, seed: int):
    """`model_cls(config)` in fp32, seeded, with the embedding scale below and the tokenizer's
    special-token ids in its generation config."""
    # fork_rng: building a model must not move the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
        # Embeddings (= the tied head) at std 0.02 cap |logit| near 0.02·H, so a frozen head under
        # LoRA could never be confident; std 0.25 allows logits up to ~0.25·H (16 at H=64).
        model.get_input_embeddings().weight.data.normal_(0.0, 0.25)
        if not config.tie_word_embeddings:
            model.get_output_embeddings().weight.data.normal_(0.0, 0.25)
    gc = model.generation_config
    gc.pad_token_id, gc.bos_token_id = tokenizer.pad_token_id, tokenizer.bos_token_id
    gc.eos_token_id = tokenizer.eos_token_id
    return model


def build_tiny_llama(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> LlamaForCausalLM:
    """Randomly initialised fp32 Llama with vocab = len(tokenizer) and the tokenizer's
    pad/bos/eos ids in both config and generation_config."""
    config = _tiny_config(
        LlamaConfig, tokenizer, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings)
    return _tiny_model(LlamaForCausalLM, config, tokenizer, seed)


def build_tiny_qwen2(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """Randomly initialised fp32 Qwen2 over the tokenizer's vocabulary, set up as
    `build_tiny_llama` sets up its Llama (same embedding scale, same special-token ids)."""
    config = _tiny_config(
        Qwen2Config, tokenizer, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings, use_sliding_window=False)
    return _tiny_model(Qwen2ForCausalLM, config, tokenizer, seed)


def tiny_model_dir(path: str | None = None, **kw) -> str:
    """Save `build_tiny_llama(build_tokenizer(), **kw)` and its tokenizer to `path` (default
    `~/.cache/grpo_lce/tiny-llama-<hash of kw>`) unless already there; return the path."""
    if path is None:
        key = json.dumps({"v": _VERSION, **kw}, sort_keys=True)
        key = hashlib.sha1(key.encode()).hexdigest()[:10]
        root = os.path.join(os.path.expanduser("~"), ".cache", "grpo_lce")
        path = os.path.join(root, f"tiny-llama-{key}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    # Build in a sibling temp dir and rename, so a concurrent or interrupted call never
    # leaves a half-written model where the next call would load it.
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tiny-")
    tok = build_tokenizer()
    build_tiny_llama(tok, **kw).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, path)
    except OSError:  # another process won the race (or path exists but is incomplete)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise
    return path
