"""The GPU branches compile on this CPU-only machine, and the checks' CPU branches pass.

`comptime if target == "gpu"` is never instantiated by CPU tests or `mojo precompile`, so
a broken GPU branch would only show on a GPU. Each tests/mojo/*_gpu_check.mojo calls an
op's execute[target]; building it for nvidia:90 type-checks and code-generates the GPU
branch. The same file built without --emit is the binary the H100 runs.
"""

import re
import subprocess
from pathlib import Path

import pytest

from pytorch_custom_ops.library import REPO_ROOT, mojo_executable

CHECKS = sorted((REPO_ROOT / "tests" / "mojo").glob("*_gpu_check.mojo"))

# PTX patterns (regexes) each check's kernels must compile to; the default is a block
# reduction (warp shuffles + barrier)
PTX_FEATURES = {
    "day012_softmax_family_gpu_check": (
        r"shfl\.sync",
        r"bar\.sync",
        # long rows split over a thread-block cluster: the cluster shape is compiled
        # into the kernel, the partial (max, sum) pairs travel through distributed
        # shared memory between two cluster barriers
        r"\.reqnctapercluster 8, 1, 1",
        r"mov\.u32\s+%r\d+, %cluster_ctarank;",
        r"barrier\.cluster\.arrive",
        r"barrier\.cluster\.wait",
        r"mapa\.shared::cluster\.u32",
        r"ld\.shared::cluster\.v2\.b32",
    ),
    "day014_gemm_gpu_check": (
        r"bar\.sync",
        r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32",
        r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16",
        # cp.async with a src-size operand: out-of-range vectors are zero-filled
        r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16, %r\d+;",
        # the Hopper kernel: warpgroup MMA from shared-memory descriptors, both tile widths
        r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16",
        r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16",
        r"wgmma\.fence\.sync\.aligned",
        r"wgmma\.commit_group\.sync\.aligned",
        r"wgmma\.wait_group\.sync\.aligned 1;",
        # cp.async writes are generic-proxy, wgmma reads async-proxy: the fence between
        r"fence\.proxy\.async\.shared::cta",
        # version 3: TMA tile copies completing on mbarriers, waits on mbarrier phases,
        # the register hand-over between producer and consumer warpgroups, and the
        # tensor maps passed as grid constants (read from kernel parameter space)
        r"cp\.async\.bulk\.tensor\.3d\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes",
        r"mbarrier\.arrive\.expect_tx\.shared\.b64",
        r"mbarrier\.try_wait\.parity\.shared::cta\.b64",
        r"setmaxnreg\.inc\.sync\.aligned\.u32 232;",
        r"setmaxnreg\.dec\.sync\.aligned\.u32 40;",
        r"cvta\.param\.u64",
    ),
}
DEFAULT_PTX_FEATURES = (r"shfl\.sync", r"bar\.sync")


@pytest.mark.parametrize("check", CHECKS, ids=lambda p: p.stem)
def test_gpu_branch_compiles_to_sm90_ptx(check: Path, tmp_path):
    cmd = [
        mojo_executable(),
        "build",
        "-I",
        str(REPO_ROOT),
        "--target-accelerator",
        "nvidia:90",
        "--emit",
        "asm",
        str(check),
        "-o",
        str(tmp_path / "out.s"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    ptx = "\n".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    assert ".target sm_90a" in ptx
    assert ".visible .entry" in ptx, "no GPU kernel was generated"
    for feature in PTX_FEATURES.get(check.stem, DEFAULT_PTX_FEATURES):
        assert re.search(feature, ptx), f"no match for {feature!r} in the PTX"


@pytest.mark.parametrize("check", CHECKS, ids=lambda p: p.stem)
def test_gpu_check_cpu_branch_passes(check: Path):
    proc = subprocess.run(
        [mojo_executable(), "run", "-I", str(REPO_ROOT), str(check)], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout


def test_there_is_a_gpu_check_per_mojo_day():
    days = {p.parent.name for p in (REPO_ROOT / "days").glob("day*/*.mojo") if p.name != "__init__.mojo"}
    checked = {p.name.split("_")[0] for p in CHECKS}
    assert days <= checked, f"days with Mojo kernels but no tests/mojo/<day>_*_gpu_check.mojo: {sorted(days - checked)}"
