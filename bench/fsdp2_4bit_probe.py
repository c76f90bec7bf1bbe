"""Does FSDP2 shard a bitsandbytes 4-bit model with the versions installed? (Upstream says no:
accelerate#3983, bitsandbytes#1945.) Two ranks each load a small NF4 Llama, `fully_shard` every
decoder layer and the root, and run one forward + backward of a LoRA-free loss on the
quantized base (bf16 parameters of norms and embeddings trainable). Prints one line per rank:
"ok" with the loss, or the exception that stopped it. A lab probe, not a test.

    python3 -m bench.fsdp2_4bit_probe          # needs 2 GPUs and bitsandbytes
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist


def _rank(rank: int, world: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    from bench import e2e_common as E

    stage = "load"
    try:
        model = E.load_model(path, device="cuda", quantize=True, gpu=rank)
        stage = "fully_shard"
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        stage = "forward/backward"
        ids = torch.randint(3, model.config.vocab_size, (2, 16), device=f"cuda:{rank}")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        print(f"rank {rank}: ok, loss {loss.item():.4f}", flush=True)
    except Exception as exc:  # noqa: BLE001 - the probe reports what stopped it
        line = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}" if str(exc) else \
            type(exc).__name__
        print(f"rank {rank}: failed at {stage}: {line}", flush=True)
        if rank == 0:
            traceback.print_exc(limit=3)
    finally:
        dist.destroy_process_group()


def main() -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainers.tiny import build_tokenizer

    # a 2-layer Llama of real widths: small, and bitsandbytes quantizes its linear layers
    path = tempfile.mkdtemp()
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=1024,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import bitsandbytes
    from torch.distributed import fsdp  # noqa: F401  (fails here if this torch lacks it)

    print(f"torch {torch.__version__}, bitsandbytes {bitsandbytes.__version__}", flush=True)
    torch.multiprocessing.spawn(_rank, args=(2, port, path), nprocs=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
