"""Compile every Triton kernel for a Hopper GPU (sm_90) on a machine without one, and report its resources.

    python -m kernels.compile_check        (TRITON_INTERPRET must be unset: this is the compiled mode)

The interpreter tests check the numerics; this checks what only the compiler sees (types through loops, dot shapes,
constexpr use) and how many registers and spill bytes the GPU launch configurations cost. It compiles as the JIT
would for 16-aligned pointers and strides (its usual specialisation), with the ptxas and cuobjdump that ship in
the triton wheel. Prints one line per kernel, `name regs=R spill=S shared=B`, and exits 1 on a compile error.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from typing import Any

FLOATS = {"scale_log2", "eps", "inv_temp"}
PTR_TYPES = dict(bt_ptr="i32", lens_ptr="i32", cu_q_ptr="i32", part_ptr="fp32", lse_ptr="fp32", slot_ptr="i64",
                 tgt_ptr="i64", zt_ptr="fp32", ez_ptr="fp32", glp_ptr="fp32", gent_ptr="fp32", temp_ptr="fp32",
                 u_ptr="fp32", tok_ptr="i64", lp_ptr="fp32")


def compile_sm90(kernel: Any, consts: dict[str, Any], num_warps: int = 4, num_stages: int = 3) -> Any:
    """kernel: a @triton.jit function. Pointers are bf16 unless PTR_TYPES says otherwise; other scalars i32 or fp32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + PTR_TYPES.get(name, "bf16")
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
        if name.endswith("_ptr") or name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def resources(compiled: Any) -> tuple[int, int]:
    """(registers, stack/spill bytes) per thread from cuobjdump, (-1, -1) where it is missing."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return -1, -1
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)) if regs else -1), (int(stack.group(1)) if stack else -1)


def cases() -> list[tuple[str, Any, dict[str, Any], dict[str, int]]]:
    """(label, kernel, constexprs, launch options) with the dispatchers' GPU configurations."""
    import kernels.triton_ops.kv_cache as kv
    import kernels.triton_ops.logprobs as lp
    import kernels.triton_ops.paged_attention as pa
    import kernels.triton_ops.paged_prefill as pp
    import kernels.triton_ops.rmsnorm as rn
    import kernels.triton_ops.rope as rp
    import kernels.triton_ops.sample as sm
    import kernels.triton_ops.swiglu as sg
    out = []
    for group, splits, window in ((2, 1, False), (4, 4, True)):  # Qwen3-0.6B and Qwen3-8B heads, D = 128
        cfg = pa.decode_config(group, 128, interpret=False)
        opts = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
        out.append((f"decode_g{group}_s{splits}", pa._decode_kernel,
                    dict(GROUP=group, HEAD_DIM=128, BLOCK_SIZE=16, NUM_SPLITS=splits, USE_WINDOW=window,
                         UPCAST=False, DOT_PREC="tf32", **cfg), opts))
    out.append(("decode_reduce", pa._reduce_kernel, dict(NUM_SPLITS=4, BLOCK_S=4, HEAD_DIM=128, BLOCK_D=128),
                dict(num_warps=4)))
    cfg = pp.prefill_config(2, 128, interpret=False)
    opts = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
    out.append(("prefill_g2", pp._prefill_kernel, dict(GROUP=2, HEAD_DIM=128, BLOCK_SIZE=16, USE_WINDOW=True,
                                                       UPCAST=False, DOT_PREC="tf32", **cfg), opts))
    out.append(("write_kv", kv._write_kv_kernel, dict(HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128),
                dict(num_warps=4)))
    out.append(("logprob_stats", lp._stats_kernel, dict(WITH_ENTROPY=True, BLOCK_V=4096), dict(num_warps=8)))
    out.append(("logprob_grad", lp._grad_kernel, dict(HAS_ENT=True, BLOCK_V=4096), dict(num_warps=8)))
    out.append(("rms_norm", rn._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK_D=1024), dict(num_warps=4)))
    out.append(("rope", rp._rope_kernel, dict(HALF=64, BLOCK_H=8, BLOCK_HALF=64), dict(num_warps=4)))
    out.append(("silu_mul", sg._silu_mul_kernel, dict(BLOCK=1024), dict(num_warps=4)))
    out.append(("sample", sm._sample_kernel, dict(BLOCK_V=4096), dict(num_warps=8)))
    return out


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: this checks the compiled mode", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the JIT's default; set to silence its deprecation note
    status = 0
    for label, kernel, consts, opts in cases():
        try:
            compiled = compile_sm90(kernel, consts, **opts)
        except Exception as e:  # noqa: BLE001 - report every kernel, fail at the end
            print(f"{label} COMPILE ERROR {type(e).__name__}: {str(e)[:300]}")
            status = 1
            continue
        regs, spill = resources(compiled)
        print(f"{label} regs={regs} spill={spill} shared={compiled.metadata.shared}")
    return status


if __name__ == "__main__":
    sys.exit(main())
