"""Compile the decode kernels for an H100 (sm_90) without a GPU: Triton's front end, its
optimizer and ptxas all run on the CPU, so a kernel that the interpreter accepts but the compiler
rejects fails here. Run by tests/test_decode_linear.py in a subprocess (the interpreter must be
off: TRITON_INTERPRET=0); prints one line per kernel with its registers and shared memory.

    TRITON_INTERPRET=0 python tests/_compile_decode_kernels.py
"""

import itertools
import re
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from trainers.sampling import decode_attention as A
from trainers.sampling.kernels import head_logits as HL
from trainers.sampling.kernels import linear4bit as L
from trainers.sampling.kernels import race as S
from trainers.sampling.kernels import record as RC
from trainers.sampling.kernels import rmsnorm as R
from trainers.sampling.kernels import rope as P

TARGET = GPUTarget("cuda", 90, 32)
# the decode linear's sizes and strides at every Llama / Qwen / Mistral layer shape
LINEAR_DIV16 = ("N_0", "N_1", "N_2", "K", "COL_1", "COL_2", "stride_xm", "stride_ar",
                "stride_bn", "stride_ym", "stride_ps", "stride_pm")


def compile_kernel(fn, types: dict, consts: dict, div16=(), **options):
    """`fn` for sm_90 as a launch specializes it: every pointer 16-byte aligned (torch's
    allocations are), and the integer arguments named in `div16` multiples of 16 (the layer
    shapes and strides), so the layouts, vector widths and registers are the GPU run's."""
    if "PDL" in fn.arg_names:  # launched without PDL unless the caller says so
        consts = {"PDL": False, **consts}
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    aligned = [n for n in fn.arg_names if sig[n].startswith("*") or n in div16]
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    kernel = triton.compile(src, target=TARGET, options=options)
    if consts.get("PDL"):  # kernels.pdl's wait, and no trigger of the next kernel
        ptx = kernel.asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        assert wait >= 0, f"{fn.__name__}: PDL=True but no griddepcontrol.wait"
        go = ptx.find("griddepcontrol.launch_dependents")
        if consts.get("NEXT_AT_START"):  # a small kernel's trigger, before its wait
            assert 0 <= go < wait, fn.__name__
        else:
            assert (go > wait) if consts.get("EARLY_NEXT") else (go < 0), fn.__name__
        # nothing is read before the wait but the decode linear's packed weight words and
        # scale operands, and the double-quant offset: the register tile's first step (4
        # vector loads, 2 absmax bytes and 2 second-level scales a thread), the block loop's
        # first block (a vector load, the scale: absmax byte, second-level scale, code2 entry)
        # and the next block's scale operands
        early = [ln for ln in ptx[:wait].splitlines() if "ld.global" in ln or "cp.async" in ln]
        kinds = sorted(ln.split("ld.global")[1].split()[0] if "ld.global" in ln else ln
                       for ln in early)
        if fn is L._linear4bit_lora_kernel and consts.get("REG_TILE"):
            assert kinds == [".b32"] * 3 + [".b8"] * 2 + [".v4.b32"] * 4, kinds
        elif fn is L._linear4bit_lora_kernel:
            assert kinds == [".b32"] * 4 + [".b8"] * 2 + [".v4.b32"], kinds
        elif fn is R._add_rmsnorm_kernel and consts.get("N_A"):
            # LoRA's factor tile (lora_t), which no kernel of a decode step writes, alone
            assert early and all("ld.global" in ln for ln in early), early
        else:
            assert not early, f"{fn.__name__} reads before grid_wait: {early}"
    print(f"{fn.__name__} {consts}: shared {kernel.metadata.shared} B")
    return kernel


def _compile_linear(nested, split, lora, lora_fp32, bs, prmt, xdt, segs=1, glu=False,
                    reg_tile=False, even_k=True, pdl=False, early_next=False):
    types = {"x_ptr": f"*{xdt}", "y_ptr": f"*{xdt}", "part_ptr": "*fp32", "count_ptr": "*i32"}
    for i in range(3):  # each segment's arguments (a grouped launch's projections)
        types.update({f"w_{i}": "*u8", f"code_{i}": "*fp32",
                      f"absmax_{i}": "*u8" if nested else "*fp32", f"code2_{i}": "*fp32",
                      f"absmax2_{i}": "*fp32", f"offset_{i}": "*fp32",
                      f"a_{i}": "*fp32" if lora_fp32 else f"*{xdt}", f"b_{i}": f"*{xdt}",
                      f"bias_{i}": f"*{xdt}", f"scaling_{i}": "fp32"})
    consts = {"SEGS": segs, "BS": bs, "BS2": 256, "NESTED": nested, "HAS_LORA": lora,
              "LORA_FP32": lora_fp32, "HAS_BIAS": True, "SPLIT": split, "LAST_REDUCES": split, "GLU": glu,
              "BLOCK_M": 16, "BLOCK_N": 64 if bs == 64 or reg_tile else 128, "BLOCK_R": 16,
              "PRMT": prmt, "PREFETCH": prmt, "REG_TILE": reg_tile,
              "EVEN_K": reg_tile and even_k, "PDL": pdl, "EARLY_NEXT": early_next,
              "INTERP": False}
    compile_kernel(L._linear4bit_lora_kernel, types, consts, div16=LINEAR_DIV16,
                   enable_fp_fusion=False, num_stages=1)


def _assert_table_first(llir: str, table_bytes: int) -> None:
    """Every other shared buffer lies past the table (no constant offset into shared memory
    below its size): with no other buffer as large, the table is then at offset 0."""
    offsets = {int(o) for o in re.findall(r"@global_smem, i32 (\d+)\)", llir)}
    low = sorted(o for o in offsets if 0 < o < table_bytes)
    assert offsets and not low, (f"shared buffers at {low} inside the pair table's bytes "
                                 f"({sorted(offsets)})")


def compile_ws_linear(nested: bool, bs: int, lora: bool, split: bool, glu: bool,
                      pdl: bool = True, bias: bool = False, pair_table: bool = True,
                      t_parts: int = 0):
    """`linear4bit_ws`'s Gluon kernel for sm_90 (its layout conversions assert, at this
    compile, that they move no data), as `linear4bit_ws.launch` launches it; with the pair
    table, that the table is the start of shared memory, where its lookups address it."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from trainers.sampling.kernels import _linear4bit_ws_kernel as WK
    from trainers.sampling.kernels import linear4bit_ws as WS

    fn = WK.linear4bit_ws_kernel
    k = 4096
    w_desc = WS._descriptor(torch.zeros(256, k // 8, dtype=torch.int32), [256, k // 8],
                            [k // 8, 1], [64, 32], 32)
    a_desc = WS._descriptor(torch.zeros(16, k, dtype=torch.bfloat16), [16, k // 64, 64],
                            [k, 64, 1], [16, 4, 64], 16)
    descs = {"x_desc": WS._descriptor(torch.zeros(8, k, dtype=torch.bfloat16),
                                      [8, k // 64, 64], [k, 64, 1], [8, 4, 64], 16)}
    consts = {"BS": bs, "BS2": 256, "NESTED": nested, "SPLIT": split,
              "STAGES": WS.stages(glu, pair_table),
              "HAS_LORA": lora, "HAS_BIAS": bias, "GLU": glu, "PDL": pdl, "EARLY_NEXT": pdl,
              "PRODUCER_REGS": WS.PRODUCER_REGS, "PAIR_TABLE": pair_table,
              "T_PARTS": t_parts}
    types = {"y_ptr": "*bf16", "part_ptr": "*fp32", "t_ptr": "*fp32"}
    for seg in "012":
        descs.update({f"w_desc{seg}": w_desc, f"a_desc{seg}": a_desc})
        types.update({f"b_ptr{seg}": "*bf16", f"code_ptr{seg}": "*fp32",
                      f"absmax_ptr{seg}": "*u8" if nested else "*fp32",
                      f"absmax2_ptr{seg}": "*fp32", f"code2_ptr{seg}": "*fp32",
                      f"offset_ptr{seg}": "*fp32", f"scaling{seg}": "fp32",
                      f"bias_ptr{seg}": "*bf16"})
    sig = {n: (mangle_type(descs[n]) if n in descs else "constexpr" if n in consts
               else types.get(n, "i32")) for n in fn.arg_names}
    div16 = [n for n in fn.arg_names if sig[n].startswith("*")] + [
        "K", "stride_bn0", "stride_bn1", "stride_bn2", "stride_ym", "stride_ps"]
    src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(c),): v
                                              for c, v in consts.items()},
                         attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]]
                                for n in div16})
    kernel = triton.compile(src, target=TARGET, options={"num_warps": 4, "maxnreg": WS.MAXNREG,
                                                         "enable_fp_fusion": False,
                                                         "launch_pdl": pdl})
    ptx = kernel.asm["ptx"]
    loop_lora = lora and not t_parts  # t given: no A copies, no t MMAs in the K loop
    assert ptx.count("mma.sync") == (16 + (4 if loop_lora else 0)) * (2 if glu else 1), \
        "MMAs a step"
    assert "cp.async.bulk.tensor" in ptx, "TMA copies"
    assert ("griddepcontrol.wait" in ptx) == pdl, "the PDL wait"
    if pair_table:
        _assert_table_first(kernel.asm["llir"], 256 * 32 * 4)
    print(f"{fn.__name__} {consts}: shared {kernel.metadata.shared} B")
    return kernel


def main():
    # both BLOCK_N that pick_config uses (64 with blocksize 64, 128 with 128), the code looked
    # up by register permutes (the GPU's path); then the memory gathers (the interpreter's
    # path, and `config={"PRMT": False}`), fp16 x and grouped launches
    for nested, split, lora, lora_fp32, bs in itertools.product(
            (False, True), (False, True), (False, True), (False, True), (64, 128)):
        if lora_fp32 and not lora:
            continue
        _compile_linear(nested, split, lora, lora_fp32, bs, True, "bf16")
    for nested, (prmt, xdt) in itertools.product((False, True), ((False, "bf16"), (True, "fp16"))):
        _compile_linear(nested, True, True, False, 64, prmt, xdt)
    for segs in (2, 3):  # grouped launches (q/k/v, gate/up)
        _compile_linear(True, True, True, False, 64, True, "bf16", segs)
    for bs, xdt in ((64, "bf16"), (128, "bf16"), (64, "fp16")):  # gate/up with silu · mul
        _compile_linear(True, True, True, False, bs, True, xdt, 2, glu=True)
    # the register tile (pick_config's choice up to 16 rows): its PRMT path at both
    # blocksizes, with and without double quant, split K and LoRA; fp16; grouped and GLU
    for nested, split, lora, lora_fp32, bs in itertools.product(
            (False, True), (False, True), (False, True), (False, True), (64, 128)):
        if lora_fp32 and not lora:
            continue
        _compile_linear(nested, split, lora, lora_fp32, bs, True, "bf16", reg_tile=True)
    _compile_linear(True, True, True, False, 64, True, "fp16", reg_tile=True)
    _compile_linear(True, True, True, False, 64, True, "bf16", reg_tile=True, even_k=False)
    _compile_linear(True, True, True, False, 64, False, "bf16", reg_tile=True)
    _compile_linear(True, True, True, False, 64, True, "bf16", 3, reg_tile=True)
    _compile_linear(True, True, True, False, 64, True, "bf16", 2, glu=True, reg_tile=True)
    compile_kernel(L._split_k_reduce_kernel,
                   {"part_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16"},
                   {"HAS_BIAS": True, "BLOCK_M": 16, "BLOCK_N": 64, "INTERP": False})
    # the norm on a tensor, without and with the residual, and on a SplitSum's partials
    # (and the first layer's, looking its rows up in the embedding table)
    # (with LoRA's t of one to three factors over 8 parts of the row: lora_t)
    for has_res, splits, gather, n_a in ((False, 0, False, 0), (True, 0, False, 0),
                                         (True, 4, False, 0), (False, 0, True, 0),
                                         (True, 2, False, 3), (True, 2, False, 2),
                                         (False, 0, True, 3), (True, 0, False, 1)):
        compile_kernel(R._add_rmsnorm_kernel,
                       {"x_ptr": "*fp32" if splits else "*bf16", "r_ptr": "*bf16",
                        "w_ptr": "*bf16", "y_ptr": "*bf16", "rout_ptr": "*bf16",
                        "xb_ptr": "*bf16", "ids_ptr": "*i64", "a0_ptr": "*bf16",
                        "a1_ptr": "*bf16", "a2_ptr": "*bf16", "t_ptr": "*fp32", "eps": "fp32"},
                       {"HAS_RESIDUAL": has_res, "X_SPLITS": splits, "HAS_XBIAS": splits > 0,
                        "GATHER": gather, "BLOCK_H": 4096, "N_A": n_a, "RANK": 16,
                        "BLOCK_R": 64 if n_a == 3 else 16 * max(n_a, 1),
                        "BLOCK_P": 512 if n_a else 4096, "INTERP": False},
                       num_warps=R.t_warps(512) if n_a else 32)
    for rows in (False, True):  # the step's record, a full batch and a bucket
        compile_kernel(RC._record_kernel,
                       {"y_ptr": "*i64", "lp_ptr": "*fp32", "done_ptr": "*i1", "eos_ptr": "*i64",
                        "out_ptr": "*i64", "logp_ptr": "*fp32", "step_ptr": "*i64",
                        "slot_ptr": "*i64", "cur_ptr": "*i64", "rows_ptr": "*i64"},
                       {"HAS_ROWS": rows, "BLOCK_B": 64, "BLOCK_E": 2, "PDL": True},
                       num_warps=1)
    # RoPE on tensors (each dtype, with and without Qwen3's norms), and on SplitSums' partials
    # (fp32, with biases) holding bf16 values, those with cos / sin tables read at the slots
    for norm, dt, wdt, splits in ((False, "bf16", "bf16", 0), (True, "bf16", "bf16", 0),
                                  (True, "bf16", "fp32", 0), (False, "fp32", "fp32", 0),
                                  (True, "fp16", "fp16", 0), (False, "bf16", "bf16", 2),
                                  (True, "bf16", "bf16", 4)):
        out = "fp32" if "fp32" in (dt, wdt) else dt
        xdt = "fp32" if splits else dt
        compile_kernel(P._rope_cache_kernel,
                       {"q_ptr": f"*{xdt}", "k_ptr": f"*{xdt}", "v_ptr": f"*{xdt}",
                        "cos_ptr": f"*{dt}", "sin_ptr": f"*{dt}", "qw_ptr": f"*{wdt}",
                        "kw_ptr": f"*{wdt}", "ck_ptr": f"*{dt}", "cv_ptr": f"*{dt}",
                        "slot_ptr": "*i64", "qo_ptr": f"*{out}", "qb_ptr": f"*{dt}",
                        "kb_ptr": f"*{dt}", "vb_ptr": f"*{dt}", "eps_q": "fp32",
                        "eps_k": "fp32"},
                       {"NORM": norm, "TABLES": splits > 0, "BLOCK_G": 8, "BLOCK_HALF": 64,
                        "INTERP": False,
                        "X_DT": {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[dt],
                        "Q_SPLITS": splits, "K_SPLITS": splits, "V_SPLITS": splits,
                        "HAS_QB": splits > 0, "HAS_KB": splits > 0, "HAS_VB": splits > 0},
                       num_warps=4, enable_fp_fusion=False)
    for nested, bs, lora, split, glu in ((True, 64, True, True, False),
                                         (True, 64, False, False, False),
                                         (True, 128, True, False, False),
                                         (False, 64, True, True, False),
                                         (True, 64, True, False, True)):
        for pair_table in (True, False):  # both lookups
            compile_ws_linear(nested, bs, lora, split, glu, pair_table=pair_table)
    compile_ws_linear(True, 64, True, True, False, pdl=False)  # outside a decode step
    for split, glu in ((False, False), (True, False), (False, True)):  # with a bias
        compile_ws_linear(True, 64, True, split, glu, bias=True)
    # LoRA's t given by the norm before (lora_t's parts): q/k/v, a split launch, gate/up
    for split, glu, pair_table in ((False, False, False), (True, False, True),
                                   (False, True, True)):
        compile_ws_linear(True, 64, True, split, glu, pair_table=pair_table, t_parts=8)
    compile_kernel(S._chunk_lse_kernel, {"z_ptr": "*fp32", "m_ptr": "*fp32", "s_ptr": "*fp32"},
                   {"BLOCK": S.BLOCK}, num_warps=8)
    for sample in (False, True):
        compile_kernel(S._chunk_race_kernel,
                       {"z_ptr": "*fp32", "e_ptr": "*fp32", "m_ptr": "*fp32", "s_ptr": "*fp32",
                        "best_ptr": "*fp32", "idx_ptr": "*i32"},
                       {"SAMPLE": sample, "BLOCK": S.BLOCK, "S_BLOCK": 32, "INTERP": False},
                       num_warps=8)
    compile_kernel(S._pick_kernel,
                   {"z_ptr": "*fp32", "m_ptr": "*fp32", "s_ptr": "*fp32", "best_ptr": "*fp32",
                    "idx_ptr": "*i32", "y_ptr": "*i64", "lp_ptr": "*fp32"},
                   {"S_BLOCK": 32}, num_warps=1)
    for dt, even, bb in (("bf16", True, 16), ("bf16", False, 64), ("fp16", True, 32)):
        compile_kernel(HL._head_logits_kernel, {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}",
                                                "z_ptr": "*fp32"},
                       {"EVEN_H": even, "BLOCK_V": HL.BLOCK_V, "BLOCK_B": bb,
                        "BLOCK_H": HL.BLOCK_H, "INTERP": False}, num_warps=4, num_stages=4)
    # programmatic dependent launch (kernels.pdl): every decode kernel with its wait, the
    # linear on both K loops
    _compile_linear(True, True, True, False, 64, True, "bf16", 2, glu=True, reg_tile=True,
                    pdl=True, early_next=True)
    _compile_linear(True, True, True, False, 64, True, "bf16", pdl=True)
    # as the decode step runs the norms (with LoRA's t of q/k/v, and of gate/up)
    for splits, gather, n_a in ((4, False, 0), (0, True, 0), (2, False, 3), (2, False, 2),
                                (0, True, 3)):
        compile_kernel(R._add_rmsnorm_kernel,
                       {"x_ptr": "*fp32" if splits else "*bf16", "r_ptr": "*bf16",
                        "w_ptr": "*bf16", "y_ptr": "*bf16", "rout_ptr": "*bf16",
                        "xb_ptr": "*bf16", "ids_ptr": "*i64", "a0_ptr": "*bf16",
                        "a1_ptr": "*bf16", "a2_ptr": "*bf16", "t_ptr": "*fp32", "eps": "fp32"},
                       {"HAS_RESIDUAL": not gather, "X_SPLITS": splits, "HAS_XBIAS": False,
                        "GATHER": gather, "BLOCK_H": 4096, "N_A": n_a, "RANK": 16,
                        "BLOCK_R": 64 if n_a == 3 else 16 * max(n_a, 1),
                        "BLOCK_P": 512 if n_a else 4096, "PDL": True, "INTERP": False,
                        "NEXT_AT_START": True},
                       num_warps=R.t_warps(512) if n_a else 32)
    compile_kernel(P._rope_cache_kernel,
                   {"q_ptr": "*fp32", "k_ptr": "*fp32", "v_ptr": "*fp32", "cos_ptr": "*bf16",
                    "sin_ptr": "*bf16", "qw_ptr": "*bf16", "kw_ptr": "*bf16", "ck_ptr": "*bf16",
                    "cv_ptr": "*bf16", "slot_ptr": "*i64", "qo_ptr": "*bf16", "qb_ptr": "*bf16",
                    "kb_ptr": "*bf16", "vb_ptr": "*bf16", "eps_q": "fp32", "eps_k": "fp32"},
                   {"NORM": False, "TABLES": True, "BLOCK_G": 8, "BLOCK_HALF": 64, "PDL": True,
                    "INTERP": False, "X_DT": tl.bfloat16, "Q_SPLITS": 2, "K_SPLITS": 2,
                    "V_SPLITS": 2, "HAS_QB": True, "HAS_KB": True, "HAS_VB": True},
                   num_warps=4, enable_fp_fusion=False)
    compile_kernel(A._decode_attention_split_kernel,
                   {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "last_ptr": "*i64",
                    "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "o_ptr": "*bf16",
                    "count_ptr": "*i32", "scale": "fp32"},
                   {"D": 64, "BLOCK_G": 16, "SPLIT": A.SPLIT_N, "BLOCK_N": A.BLOCK_N_FEW,
                    "HAS_WINDOW": False, "IEEE": False, "COMBINE": True, "PDL": True,
                    "INTERP": False, "NEXT_AT_START": True}, num_warps=4)
    # RoPE + cache write + attention in one launch: plain q/k/v, and SplitSums with biases
    for splits, bias in ((0, False), (2, True)):
        part = "*fp32" if splits else "*bf16"
        compile_kernel(A._rope_attention_kernel,
                       {"q_ptr": part, "k_ptr": part, "v_ptr": part, "cos_ptr": "*bf16",
                        "sin_ptr": "*bf16", "qb_ptr": "*bf16", "kb_ptr": "*bf16",
                        "vb_ptr": "*bf16", "ck_ptr": "*bf16", "cv_ptr": "*bf16",
                        "last_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32",
                        "acc_ptr": "*fp32", "o_ptr": "*bf16", "count_ptr": "*i32",
                        "scale": "fp32"},
                       {"D": 128, "BLOCK_G": 16, "SPLIT": A.SPLIT_N, "BLOCK_N": A.BLOCK_N_FEW,
                        "HAS_WINDOW": False, "COMBINE": True, "X_DT": tl.bfloat16,
                        "Q_SPLITS": splits, "K_SPLITS": splits, "V_SPLITS": splits,
                        "HAS_QB": bias, "HAS_KB": bias, "HAS_VB": bias, "PDL": True,
                        "INTERP": False, "NEXT_AT_START": True}, num_warps=4)
    compile_kernel(S._chunk_lse_kernel, {"z_ptr": "*fp32", "m_ptr": "*fp32", "s_ptr": "*fp32"},
                   {"BLOCK": S.BLOCK, "PDL": True}, num_warps=8)
    compile_kernel(S._chunk_race_kernel,
                   {"z_ptr": "*fp32", "e_ptr": "*fp32", "m_ptr": "*fp32", "s_ptr": "*fp32",
                    "best_ptr": "*fp32", "idx_ptr": "*i32"},
                   {"SAMPLE": True, "BLOCK": S.BLOCK, "S_BLOCK": 32, "PDL": True,
                    "INTERP": False}, num_warps=8)
    compile_kernel(S._pick_kernel,
                   {"z_ptr": "*fp32", "m_ptr": "*fp32", "s_ptr": "*fp32", "best_ptr": "*fp32",
                    "idx_ptr": "*i32", "y_ptr": "*i64", "lp_ptr": "*fp32"},
                   {"S_BLOCK": 32, "PDL": True}, num_warps=1)
    compile_kernel(HL._head_logits_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "z_ptr": "*fp32"},
                   {"EVEN_H": True, "BLOCK_V": HL.BLOCK_V, "BLOCK_B": 16, "BLOCK_H": HL.BLOCK_H,
                    "PDL": True, "INTERP": False}, num_warps=4, num_stages=4)
    print("all compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
