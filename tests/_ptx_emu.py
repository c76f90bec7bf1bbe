"""A reference interpreter for the few PTX instructions of the decode linear's inline assembly
(linear4bit._table_asm, _DEQUANT_ASM), so a CPU test can run the exact strings the GPU compiles.
Semantics from the PTX ISA: prmt.b32 in its default mode (a 3-bit byte index per selector nibble,
the nibble's bit 3 replicates the chosen byte's sign), cvt.rn.{bf16x2,f16x2}.f32 (a to the upper
half, b to the lower, round to nearest even), mul.rn.f32 (one rounding), mul.hi.u32 (the upper
32 bits of the 64-bit product), lop3.b32 (result bit i is bit 4a_i + 2b_i + c_i of the truth
table: 0xF0, 0xCC, 0xAA are a, b, c)."""

import re

import numpy as np

M32 = 0xFFFFFFFF


def f32_bits(v) -> int:
    return int(np.array(v, dtype=np.float32).view(np.uint32))


def bits_f32(b: int) -> np.float32:
    return np.array(b & M32, dtype=np.uint32).view(np.float32)[()]


def half_bits(v: np.float32, kind: str) -> int:
    """fp32 -> bf16 / fp16 bits, round to nearest even."""
    if kind == "f16":
        return int(np.array(v, dtype=np.float32).astype(np.float16).view(np.uint16))
    b = f32_bits(v)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def prmt(a: int, b: int, c: int) -> int:
    src = (a & M32) | ((b & M32) << 32)
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (src >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def run(asm: str, operands: list[int]) -> list[int]:
    """Run `asm` over `operands` ($i, 32-bit values; outputs written in place); returns them."""
    ops, regs = list(operands), {}

    def get(t):
        t = t.strip()
        if t.startswith("$"):
            return ops[int(t[1:])]
        if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", t):
            return int(t, 0)
        return regs[t]

    def put(t, v):
        t = t.strip()
        if t.startswith("$"):
            ops[int(t[1:])] = v & M32
        else:
            regs[t] = v & M32

    for stmt in asm.split(";"):
        stmt = stmt.strip().strip("{}").strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        d, *args = (a.strip() for a in rest.split(","))
        if op == "and.b32":
            put(d, get(args[0]) & get(args[1]))
        elif op == "or.b32":
            put(d, get(args[0]) | get(args[1]))
        elif op == "mul.hi.u32":
            put(d, ((get(args[0]) & M32) * (get(args[1]) & M32)) >> 32)
        elif op == "lop3.b32":  # bit i of the result: bit (a_i b_i c_i) of the truth table
            a, b, c, lut = (get(x) & M32 for x in args)
            put(d, sum(((lut >> (4 * ((a >> i) & 1) + 2 * ((b >> i) & 1) + ((c >> i) & 1)))
                        & 1) << i for i in range(32)))
        elif op == "shr.u32":
            put(d, (get(args[0]) & M32) >> get(args[1]))
        elif op == "cvt.u32.u16":
            put(d, get(args[0]) & 0xFFFF)
        elif op == "prmt.b32":
            put(d, prmt(get(args[0]), get(args[1]), get(args[2])))
        elif op == "mul.rn.f32":
            put(d, f32_bits(bits_f32(get(args[0])) * bits_f32(get(args[1]))))
        elif op in ("cvt.rn.bf16x2.f32", "cvt.rn.f16x2.f32"):
            kind = "bf16" if "bf16" in op else "f16"
            hi, lo = (half_bits(bits_f32(get(a)), kind) for a in args)
            put(d, (hi << 16) | lo)
        else:
            raise ValueError(f"no emulation for {op!r}")
    return ops
