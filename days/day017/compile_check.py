"""Compile day017's kernels for the H100 (sm_90) without a GPU and report their resources.

    python -m days.day017.compile_check                 # every config in CONFIGS, causal
    python -m days.day017.compile_check --kernel fwd --head-dim 128 --both

For each (kernel, head dim, config): shared memory (the H100 allows 227 KiB a block; more
fails the exit status), registers per thread (255 at most) and the bytes ptxas spilled to local
memory, plus whether the dots became wgmma (Hopper's asynchronous tensor-core MMA) or mma.sync.
Registers are read from ptxas -v, whose output Triton 3.6's bundled ptxas gives
(PYTHONPATH=<triton 3.6>:$PWD to check the GPU machine's version). Triton's bundled ptxas does the work, so
this catches configs that would fail or spill before any GPU time is spent. The signature mimics
a launch on contiguous bf16 tensors (16-byte aligned pointers and strides, GROUP == 1).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile for real, even on a machine without CUDA

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from days.day017 import flash_attention as fa  # noqa: E402

SMEM_LIMIT = 227 * 1024


PTRS = {"Q", "K", "V", "Out", "DO", "DQ", "DK", "DV"}  # of the input dtype
F32_PTRS = {"LSE", "DELTA"}
FLOATS = {"qk_scale", "sm_scale"}
CONSTEXPRS = {"HEAD_DIM", "CAUSAL", "BLOCK_M", "BLOCK_N", "UPCAST", "GROUP"}  # GROUP == 1 is specialized


def _signature(kernel: str, dtype: str) -> tuple[dict, set[str]]:
    """Triton signature types by argument name, and the names specialized as 16-divisible."""
    sig, aligned = {}, set()
    for name in fa._KERNELS[kernel].arg_names:
        if name in PTRS or name in F32_PTRS:
            sig[name] = f"*{dtype}" if name in PTRS else "*fp32"
            aligned.add(name)
        elif name in FLOATS:
            sig[name] = "fp32"
        elif name in CONSTEXPRS:
            sig[name] = "constexpr"
        else:  # ints: strides and bucketed lengths are multiples of 16, Lq/Lk/Hq need not be
            sig[name] = "i32"
            if name.startswith("stride_") or name.endswith("_KEY"):
                aligned.add(name)
    return sig, aligned


def compile_one(kernel: str, head_dim: int, spec, causal: bool, dtype: str = "bf16", arch: int = 90) -> dict:
    fn = fa._KERNELS[kernel]
    bm, bn, warps, stages = spec
    sig, aligned = _signature(kernel, dtype)
    constexprs = {"HEAD_DIM": head_dim, "CAUSAL": causal, "BLOCK_M": bm, "BLOCK_N": bn, "UPCAST": False, "GROUP": 1}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    t0 = time.perf_counter()
    row = {"kernel": kernel, "head_dim": head_dim, "causal": causal, "config": spec}
    try:
        ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
    except Exception as exc:  # noqa: BLE001 - report every failure as a row
        return {**row, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    row["compile_s"] = time.perf_counter() - t0
    row["smem_kib"] = ck.metadata.shared / 1024
    ptx = ck.asm["ptx"]
    row["wgmma"] = "wgmma.mma_async" in ptx
    row.update(_ptxas_stats(ptx, arch))
    return row


def _ptxas_stats(ptx: str, arch: int) -> dict:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        out = subprocess.run(
            [str(ptxas), f"-arch=sm_{arch}a", "-v", str(path), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
        )
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return {"regs": int(regs.group(1)) if regs else None, "spill_bytes": int(spill.group(1)) if spill else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=sorted(fa.CONFIGS), action="append")
    parser.add_argument("--head-dim", type=int, choices=fa.HEAD_DIMS, action="append")
    parser.add_argument("--both", action="store_true", help="causal and non-causal (default: causal only)")
    args = parser.parse_args(argv)
    bad = 0
    print(f"triton {triton.__version__}, sm_90")
    for kernel in args.kernel or sorted(fa.CONFIGS):
        for d in args.head_dim or fa.HEAD_DIMS:
            for spec in fa.CONFIGS[kernel][d]:
                for causal in (True, False) if args.both else (True,):
                    r = compile_one(kernel, d, spec, causal)
                    if "error" in r:
                        bad += 1
                        print(f"{kernel:5s} d={d:3d} causal={causal!s:5s} {spec}  ERROR {r['error']}")
                        continue
                    ok = r["smem_kib"] * 1024 <= SMEM_LIMIT
                    bad += not ok
                    flag = "" if ok else "  <-- over the shared memory"
                    flag = flag or ("  (spills)" if r["spill_bytes"] else "")
                    print(
                        f"{kernel:5s} d={d:3d} causal={causal!s:5s} {spec}  smem {r['smem_kib']:6.1f} KiB  "
                        f"regs {r['regs']}  spill {r['spill_bytes']} B  wgmma {r['wgmma']}  "
                        f"({r['compile_s']:.1f} s){flag}",
                        flush=True,
                    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
