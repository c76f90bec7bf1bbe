"""A few calls of the decode linear on one layer shape, for a profiler to attach to.

    ncu --kernel-name regex:_linear4bit --launch-skip 3 --launch-count 1 --set full \\
        python -m bench.profile_decode_linear --n 8192 --k 2048 --rows 8

NF4 with double quant and LoRA r = 16 (bench.decode_linear.make_module), or the base weight
alone (`--no-lora`); `--config` a JSON dict of linear4bit_lora's tile keys (default:
pick_config). Eight calls, then a sync.
"""

import argparse
import json

import torch

from bench.decode_linear import make_module
from trainers.sampling.kernels.linear4bit import Packed4bit, linear4bit_lora


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=8192, help="out_features")
    p.add_argument("--k", type=int, default=2048, help="in_features")
    p.add_argument("--rows", type=int, default=8, help="M")
    p.add_argument("--config", default=None, help="JSON tile config")
    p.add_argument("--no-lora", action="store_true", help="the base weight alone (no LoRA term)")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    mod = make_module(a.n, a.k, 16, dev)
    base = mod.get_base_layer()
    w = Packed4bit.from_quant_state(base.weight.data, base.weight.quant_state)
    x = torch.randn(a.rows, a.k, device=dev).to(torch.bfloat16)
    cfg = json.loads(a.config) if a.config else None
    lora = {} if a.no_lora else {"lora_a": mod.lora_A["default"].weight,
                                 "lora_b": mod.lora_B["default"].weight, "scaling": 2.0}
    for _ in range(8):
        linear4bit_lora(x, w, config=cfg, **lora)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
