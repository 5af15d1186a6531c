"""What a kernel's k-loop executes, from its SASS: no GPU needed.

    pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm   # or a CUDA toolkit on PATH
    python -m pytorch_custom_ops.gpu_build --cubin
    python days/day018/sass_kloop.py build/gpu/day018-*/day018.attention_fwd_kernel.bfloat16.128.128.3.0.3.*.cubin

For each cubin: the innermost loop (a backward branch) that holds at least --min-wgmma
HGMMA instructions, with its instruction count and the ones that tell how the loop's
bookkeeping runs: uniform-datapath instructions (`U...`, scalar per warp, off the vector
ALUs), `R2UR` (a vector value moved to a uniform register, e.g. a wgmma descriptor),
`LOP3`/`IMAD` (vector integer work), `LDL`/`STL` (spills). With --hot, also the loop
without the block its first branch after `WARPGROUP.DEPBAR.LE gsb0, 0x1` skips (in day
018's forward: the mask, which only the ragged and diagonal tiles run).

Day 018 used it to find why version 4 lost 10% (a lane-0 branch took the k-loop off the
uniform datapath) and what `ring_slot` saves; day 019 to count version 4's k-step.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

_LINE = re.compile(r"\s*/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;")
_GUARD = re.compile(r"^@!?U?P[0-9T]\s+")
_BRANCH = re.compile(r"^BRA(?:\.\S+)?\s+(0x[0-9a-f]+)")


def _tool(name: str) -> str:
    """A CUDA binary from PATH, else from the nvidia-cuda-* wheels."""
    found = shutil.which(name)
    if found:
        return found
    for root in sys.path:
        for path in glob.glob(os.path.join(root, "nvidia", "cu*", "bin", name)):
            return path
    raise SystemExit(f"sass_kloop: {name} not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")


def disassemble(cubin: str) -> str:
    cuobjdump, nvdisasm = _tool("cuobjdump"), _tool("nvdisasm")
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
    done = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, env=env)
    if done.returncode != 0 or "fatal" in done.stdout:
        raise SystemExit(f"sass_kloop: cuobjdump failed on {cubin}: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def parse(sass: str) -> list[tuple[int, str]]:
    """(address, instruction without its predicate guard) of each SASS line."""
    out = []
    for line in sass.splitlines():
        m = _LINE.match(line)
        if m:
            out.append((int(m.group(1), 16), _GUARD.sub("", m.group(2).strip())))
    return out


def innermost_loop(ins: list[tuple[int, str]], min_wgmma: int) -> list[tuple[int, str]]:
    """The smallest backward-branch range holding at least min_wgmma HGMMA."""
    best = None
    for addr, op in ins:
        m = _BRANCH.match(op)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            body = [(a, o) for a, o in ins if lo <= a <= addr]
            if sum(o.startswith("HGMMA") for _, o in body) >= min_wgmma and (best is None or len(body) < len(best)):
                best = body
    if best is None:
        raise ValueError(f"no loop with {min_wgmma} HGMMA")
    return best


def hot_path(body: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The loop without the block its first branch after the first wait_group 1 skips."""
    k = next((k for k, (_, o) in enumerate(body) if o.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x1")), None)
    if k is None:
        return body
    for addr, op in body[k + 1 : k + 4]:
        m = _BRANCH.match(op)
        if m and int(m.group(1), 16) > addr:
            skip_to = int(m.group(1), 16)
            return [(a, o) for a, o in body if a <= addr or a >= skip_to]
    return body


@dataclass
class Counts:
    instructions: int
    wgmma: int
    uniform: int
    r2ur: int
    lop3: int
    imad: int
    spills: int

    def __str__(self) -> str:
        return (
            f"{self.instructions:5d} instr, {self.wgmma:2d} HGMMA, uniform {self.uniform:4d}, R2UR {self.r2ur:3d}, "
            f"LOP3 {self.lop3:4d}, IMAD {self.imad:3d}, LDL/STL {self.spills}"
        )


def count(body: list[tuple[int, str]]) -> Counts:
    ops = collections.Counter(o.split()[0].split(".")[0] for _, o in body)
    return Counts(
        instructions=len(body),
        wgmma=ops["HGMMA"],
        uniform=sum(n for op, n in ops.items() if op.startswith("U")),
        r2ur=ops["R2UR"],
        lop3=ops["LOP3"],
        imad=ops["IMAD"],
        spills=ops["LDL"] + ops["STL"],
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cubins", nargs="+")
    p.add_argument("--min-wgmma", type=int, default=8, help="HGMMA a k-loop holds at least (default 8)")
    p.add_argument("--hot", action="store_true", help="also the loop without the block its first branch skips")
    args = p.parse_args(argv)
    for cubin in args.cubins:
        body = innermost_loop(parse(disassemble(cubin)), args.min_wgmma)
        print(f"{os.path.basename(cubin)}\n  loop     {count(body)}")
        if args.hot:
            print(f"  hot path {count(hot_path(body))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
