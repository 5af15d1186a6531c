"""Writes days/day018/pv_wgmma_{D}x{K}.mojo (O += P V) and operand_hold.mojo.

    python -m days.day018.gen_pv_wgmma

Why generated: P comes from registers (wgmma's register-A form), and wgmma reads those
registers asynchronously. Issued one instruction per Mojo call, the compiler may reuse a
P register for the next k step (or move the accumulator) before the hardware has read it.
So one asm block fences, issues all BN/16 k steps and commits, and a second one waits
with O tied in and out and P as inputs: nothing the hardware still owns is touched in
between. The operand list (D/2 accumulators, BN/4 P registers, BN/16
descriptors) and result type must be spelled out per shape, hence this script.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

# (head dim D, k of the product: forward 128 or 192 keys, backward 64)
SHAPES = ((64, 128), (128, 128), (128, 192), (64, 64), (128, 64))
HERE = Path(__file__).parent


def _pack(n: int) -> str:
    return ", ".join(["Float32"] * n)


def _vals(name: str, n: int) -> str:
    return ", ".join(f"{name}[{i}]" for i in range(n))


def lanes(n: int) -> int:
    """n rounded up to a power of two: Mojo's SIMD widths must be one (a 192-key tile's
    96 scores a thread travel in a SIMD of 128, the last 32 unused)."""
    return 1 << (n - 1).bit_length()


def pv(d: int, bn: int) -> str:
    """O += P V: fence, BN/16 wgmma k steps, commit; `pv_wait` ends them."""
    nacc, nreg, ndesc = d // 2, bn // 4, bn // 16
    first_reg, first_desc = nacc, nacc + nreg
    one_at = first_desc + ndesc
    acc = ", ".join(f"${i}" for i in range(nacc))
    lines = []
    for kk in range(ndesc):
        regs = ", ".join(f"${first_reg + 4 * kk + i}" for i in range(4))
        operands = f"{{{acc}}}, {{{regs}}}, ${first_desc + kk}, p, 1, 1, 1"
        lines.append(f'            "wgmma.mma_async.sync.aligned.m64n{d}k16.f32." + ab + " {operands};\\n"')
    constraints = "=f," * nacc + "r," * nreg + "l," * ndesc + "r," + ",".join(str(i) for i in range(nacc))
    body = "\n".join(lines)
    tail = "wgmma.commit_group.sync.aligned;\\n}"
    name = f"pv_wgmma_issue_{d}x{bn}"
    what = "and returns with them in flight: `pv_wait` ends them"
    return f'''

@always_inline
def {name}[
    dtype: DType
](
    p: SIMD[DType.uint32, {lanes(nreg)}],
    descs: SIMD[DType.int64, {lanes(ndesc)}],
    o: SIMD[DType.float32, {nacc}],
) -> SIMD[DType.float32, {nacc}]:
    """O (64 x {d}) += P (64 x {bn}, registers) V ({bn} x {d}, shared, mn-major); commits {what}."""
    comptime ab = "bf16.bf16" if dtype == DType.bfloat16 else "f16.f16"
    var r = inlined_assembly[
        (
            "{{\\n.reg .pred p;\\nsetp.ne.b32 p, ${one_at}, 0;\\nwgmma.fence.sync.aligned;\\n"
{body}
            "{tail}"
        ),
        _RegisterPackType[{_pack(nacc)}],
        constraints="{constraints}",
    ]({_vals("p", nreg)}, {_vals("descs", ndesc)}, Int32(1), {_vals("o", nacc)})
    return SIMD[DType.float32, {nacc}]({_vals("r", nacc)})
'''


def pv_wait(d: int, bn: int) -> str:
    """wait_group 0 that holds O (tied in and out) and P (read) across it, so the compiler
    neither reuses P's registers nor reads O while the hardware still owns them."""
    nacc, nreg = d // 2, bn // 4
    constraints = "=f," * nacc + ",".join(str(i) for i in range(nacc)) + ",r" * nreg
    return f'''

@always_inline
def pv_wait_{d}x{bn}(
    p: SIMD[DType.uint32, {lanes(nreg)}], o: SIMD[DType.float32, {nacc}]
) -> SIMD[DType.float32, {nacc}]:
    """Wait for every wgmma in flight; O comes out of here, P stays untouched until here."""
    var r = inlined_assembly[
        "wgmma.wait_group.sync.aligned 0;",
        _RegisterPackType[{_pack(nacc)}],
        constraints="{constraints}",
    ]({_vals("o", nacc)}, {_vals("p", nreg)})
    return SIMD[DType.float32, {nacc}]({_vals("r", nacc)})
'''


def hold(n: int) -> str:
    """An empty asm through which n accumulator registers pass: placed after a wait, every
    later use of them depends on it (CUTLASS calls this a fence on the operand)."""
    constraints = "=f," * n + ",".join(str(i) for i in range(n))
    return f'''

@always_inline
def hold_{n}(v: SIMD[DType.float32, {n}]) -> SIMD[DType.float32, {n}]:
    var r = inlined_assembly[
        "", _RegisterPackType[{_pack(n)}], constraints="{constraints}"
    ]({_vals("v", n)})
    return SIMD[DType.float32, {n}]({_vals("r", n)})
'''


def s_qk(d: int, bn: int) -> str:
    """S = Q K^T (64 x bn, d/16 k steps, both operands k-major in shared memory), issued and
    committed: for tiles whose scores Mojo's wgmma_async cannot hold (96 a thread at bn =
    192). The first k step's scale-d is 0, so S needs no zeroed input."""
    nacc, nk = bn // 2, d // 16
    acc = ", ".join(f"${i}" for i in range(nacc))
    lines = []
    for ks in range(nk):
        scale = "q" if ks else "z"
        operands = f"{{{acc}}}, ${nacc + ks}, ${nacc + nk + ks}, {scale}, 1, 1, 0, 0"
        lines.append(f'            "wgmma.mma_async.sync.aligned.m64n{bn}k16.f32." + ab + " {operands};\\n"')
    constraints = "=f," * nacc + ",".join(["l"] * (2 * nk))
    body = "\n".join(lines)
    pad = ", ".join(["0"] * (lanes(nacc) - nacc))
    return f'''

@always_inline
def s_wgmma_issue_64x{bn}[
    dtype: DType
](
    a_descs: SIMD[DType.int64, {nk}], b_descs: SIMD[DType.int64, {nk}]
) -> SIMD[DType.float32, {lanes(nacc)}]:
    """S (64 x {bn}) = Q (64 x {d}) K^T, from shared memory; commits and returns with it in
    flight (the caller waits, then `hold`s). Lanes {nacc}.. are 0 and unused."""
    comptime ab = "bf16.bf16" if dtype == DType.bfloat16 else "f16.f16"
    var r = inlined_assembly[
        (
            "{{\\n.reg .pred z, q;\\nsetp.ne.b32 z, 0, 0;\\nsetp.eq.b32 q, 0, 0;\\nwgmma.fence.sync.aligned;\\n"
{body}
            "wgmma.commit_group.sync.aligned;\\n}}"
        ),
        _RegisterPackType[{_pack(nacc)}],
        constraints="{constraints}",
    ]({_vals("a_descs", nk)}, {_vals("b_descs", nk)})
    return SIMD[DType.float32, {lanes(nacc)}]({_vals("r", nacc)}, {pad})
'''


def hold_part(n: int) -> str:
    """`hold` for the first n lanes of a wider SIMD (the rest are unused padding)."""
    constraints = "=f," * n + ",".join(str(i) for i in range(n))
    pad = ", ".join(["0"] * (lanes(n) - n))
    return f'''

@always_inline
def hold_{n}(v: SIMD[DType.float32, {lanes(n)}]) -> SIMD[DType.float32, {lanes(n)}]:
    var r = inlined_assembly[
        "", _RegisterPackType[{_pack(n)}], constraints="{constraints}"
    ]({_vals("v", n)})
    return SIMD[DType.float32, {lanes(n)}]({_vals("r", n)}, {pad})
'''


def main() -> None:
    head = (
        "# Generated by days/day018/gen_pv_wgmma.py, then `mojo format`: do not edit (its\n"
        "# docstring says why these are generated).\n\n"
        "from std.sys import _RegisterPackType\n"
        "from std.sys._assembly import inlined_assembly\n"
    )
    for d, bn in SHAPES:
        extra = s_qk(d, bn) if lanes(bn // 2) != bn // 2 else ""
        (HERE / f"pv_wgmma_{d}x{bn}.mojo").write_text(head + pv(d, bn) + pv_wait(d, bn) + extra)
    (HERE / "operand_hold.mojo").write_text(head + hold(32) + hold(64) + hold_part(96))
    subprocess.run(["mojo", "format", "-q", *(str(p) for p in HERE.glob("*.mojo"))], check=False)


if __name__ == "__main__":
    # no options: `--help` shows the docstring instead of rewriting the files
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
