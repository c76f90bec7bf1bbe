"""Probe: does a replayed decode-loop graph see LoRA weights changed in place after capture?

For each (base, kernels, update) variant: capture on the initial weights, change the LoRA
weights in place (an SGD step after a training forward/backward, or an in-place random add with
no forward/backward in between), then compare greedy tokens of (a) the replayed graph,
(b) a fresh loop (new capture), (c) the loop without capture, against eager `generate`."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_sampling_loop import _gpu_prompts, gpu_lora_llama, hf_completions

from trainers.sampling import DecodeLoop


def agree(a, b):
    return sum(x == y for x, y in zip(a, b)), len(b)


def main():
    import tempfile
    gc = GenerationConfig(max_new_tokens=48, do_sample=False, pad_token_id=0, eos_token_id=[1])
    for quant, kernels, update, between in [
            ("nf4", "torch", "fwdbwd", True), ("nf4", "torch", "sgd", True),
            ("nf4", "torch", "inplace", True), ("nf4", "torch", "sgd", False),
            ("bf16", "torch", "sgd", True), ("nf4", "auto", "sgd", True)]:
        with tempfile.TemporaryDirectory() as tmp:
            model = gpu_lora_llama(quant, tmp)
        ids, mask = _gpu_prompts(512)
        loop = DecodeLoop(check_every=16, kernels=kernels)
        before = loop.generate(model, ids, mask, gc).token_ids
        params = [p for n, p in model.named_parameters() if "lora_" in n]
        ptrs = [p.data_ptr() for p in params]
        seq = torch.cat([ids, torch.randint(3, 512, (ids.shape[0], 8), device="cuda")], 1)
        if update in ("sgd", "fwdbwd"):  # fwdbwd: the training pass, weights left as they are
            opt = torch.optim.SGD(params, lr=5.0 if update == "sgd" else 0.0)
            model(input_ids=seq, attention_mask=torch.ones_like(seq), labels=seq).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:  # a small in-place change, no other work in between
            g = torch.Generator(device="cuda").manual_seed(3)
            with torch.no_grad():
                for p in params:
                    p.add_(torch.randn(p.shape, generator=g, device="cuda") * 0.02)
        assert ptrs == [p.data_ptr() for p in params]
        ref = hf_completions(model, ids, mask, gc) if between else None  # eager generate first
        replay = loop.generate(model, ids, mask, gc).token_ids
        ref = ref if between else hf_completions(model, ids, mask, gc)
        again = loop.generate(model, ids, mask, gc).token_ids
        fresh = DecodeLoop(check_every=16, kernels=kernels).generate(model, ids, mask, gc)
        fresh = fresh.token_ids if fresh is not None else []
        eager = DecodeLoop(check_every=16, kernels=kernels, capture=False).generate(
            model, ids, mask, gc)
        eager = eager.token_ids if eager is not None else []
        print(f"{quant:5s} kernels={kernels:5s} update={update:8s} generate-first={between} "
              f"captures={loop.stats.captures} rows equal to eager generate: before-step "
              f"{agree(before, ref)} replay {agree(replay, ref)} replay-again {agree(again, ref)} "
              f"fresh {agree(fresh, ref)} no-capture {agree(eager, ref)}; replay=before "
              f"{agree(replay, before)} replay=fresh {agree(replay, fresh)} replay=no-capture "
              f"{agree(replay, eager)} replay=again {agree(replay, again)}", flush=True)
        del model, loop
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
