"""trainers.tiny: the offline tokenizer, tiny Llama and cached model directory.

Covers: character-level round trip, special and chat-role tokens, the chat template (generation
prompt, assistant mask through the `{% generation %}` markers), model config ids and forward
shapes, seeding (same seed same weights, caller's RNG untouched), and that `tiny_model_dir`
builds once, reuses the directory and loads back through the Auto classes. No network.

    python -m pytest tests/test_tiny.py -q
"""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainers.tiny import ROLES, build_tiny_llama, build_tokenizer, tiny_model_dir

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "12+7="},
    {"role": "assistant", "content": "19"},
]


def test_tokenizer_round_trip_and_specials():
    tok = build_tokenizer()
    text = "12+34=46, (x*y)/2 - 7 != 3.5?\nHello World!"
    ids = tok(text).input_ids
    assert len(ids) == len(text)  # one token per character, no bos/eos added
    assert tok.decode(ids) == text
    assert tok.unk_token_id not in ids
    specials = [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id]
    assert None not in specials and len(set(specials)) == 4
    for role in ROLES:  # role markers are single tokens, never split into characters
        assert len(tok(role, add_special_tokens=False).input_ids) == 1
    assert tok.decode(tok("7<eos>").input_ids, skip_special_tokens=True) == "7"


def test_chat_template():
    tok = build_tokenizer()
    text = tok.apply_chat_template(MESSAGES, tokenize=False)
    assert text == "<bos><|system|>Be brief.<|end|><|user|>12+7=<|end|><|assistant|>19<eos>"
    prompt = tok.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("<|assistant|>")
    out = tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(masked) == "19<eos>"  # the answer and the stop token are trained


def test_tiny_llama_config_forward_and_seed():
    tok = build_tokenizer()
    state = torch.random.get_rng_state()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    assert torch.equal(state, torch.random.get_rng_state())  # caller's RNG untouched
    cfg = model.config
    assert cfg.vocab_size == len(tok) and model.dtype == torch.float32
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (
        tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert cfg.tie_word_embeddings
    ids = torch.tensor([tok("3+4=7").input_ids, tok("9+9=9").input_ids])  # (2, 5)
    logits = model(ids).logits
    assert logits.shape == (2, 5, len(tok)) and torch.isfinite(logits).all()
    same = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    other = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             seed=1)
    w = model.model.layers[0].mlp.up_proj.weight
    assert torch.equal(w, same.model.layers[0].mlp.up_proj.weight)
    assert not torch.equal(w, other.model.layers[0].mlp.up_proj.weight)
    untied = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                              tie_word_embeddings=False, intermediate_size=48)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    assert untied.model.layers[0].mlp.up_proj.out_features == 48


def test_tiny_model_dir_builds_once_and_loads(tmp_path):
    path = str(tmp_path / "tiny")
    kw = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}
    assert tiny_model_dir(path, **kw) == path
    cfg = os.path.join(path, "config.json")
    mtime = os.path.getmtime(cfg)
    assert tiny_model_dir(path, **kw) == path and os.path.getmtime(cfg) == mtime  # reused
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert tok.chat_template == build_tokenizer().chat_template
    ids = torch.tensor([tok("5+5=").input_ids])
    ref = build_tiny_llama(build_tokenizer(), **kw)
    torch.testing.assert_close(model(ids).logits, ref(ids).logits)
    # default location: keyed on the kwargs, under ~/.cache/grpo_lce
    default = tiny_model_dir(**kw)
    assert os.path.basename(default).startswith("tiny-llama-")
    assert os.path.isfile(os.path.join(default, "tokenizer.json"))
