"""The GPU kernels compile on this CPU-only machine, to the instructions each day relies on.

Since day016 every GPU kernel is launched by pytorch_custom_ops from PTX built ahead of
time (`python -m pytorch_custom_ops.gpu_build`): the build itself is the proof that each
declared kernel type-checks and code-generates for sm_90a, and tests/test_direct_launch.py
checks every launcher's arguments against its kernel's `.entry`. Here: the PTX of each
day contains the instructions the day's design depends on, so a change that silently
loses them (a cluster kernel without its cluster barrier, a GEMM without wgmma) fails CI.
"""

from __future__ import annotations

import fnmatch
import re

import pytest

from pytorch_custom_ops import gpu_build
from pytorch_custom_ops.gpu_kernels import all_kernels
from pytorch_custom_ops.library import REPO_ROOT

# day -> {kernel-key glob: PTX regexes that must all appear in the PTX of those kernels}
PTX_FEATURES: dict[str, dict[str, tuple[str, ...]]] = {
    "day009": {"day009.online_softmax_kernel.*": (r"shfl\.sync", r"bar\.sync")},
    # the heads' copies: 16-byte rows where they fit, else element by element
    "day016": {
        "day016.permute_copy_kernel.bfloat16.8": (r"ld\.global\.v4\.b32", r"st\.global\.v4\.b32"),
        "day016.permute_copy_kernel.bfloat16.1": (r"ld\.global\.b16", r"st\.global\.b16"),
        # the layer norm's one-launch backward: 16-byte rows, column sums added across the
        # block in dynamic shared memory, the row workers' butterflies
        "day016.layer_norm_bwd_one_kernel.bfloat16.bfloat16.float32.8.32.6.12": (
            r"ld\.global\.v4\.b32",
            r"\.extern \.shared",
            r"bar\.sync",
            r"shfl\.sync\.bfly",
            r"\.maxntid 384\b",
        ),
        # a linear layer's backward in one grid: day 014's SIMT tiles (16-byte loads and
        # stores, float32 FMAs, a barrier per k-step) and 256-thread column blocks
        "day016.gemm_backward_one_kernel.float32.1.1.64.16.4": (
            r"ld\.global\.v4\.b32",
            r"fma\.rn\.f32",
            r"st\.global\.v4\.b32",
            r"bar\.sync",
            r"\.maxntid 256\b",
        ),
    },
    "day012": {
        # a warp per row: butterfly shuffles, 16-byte vectors, 128-thread blocks (no barrier: below)
        "day012.softmax_rows_kernel.float32.0.4.8.32.128": (
            r"shfl\.sync\.bfly\.b32",
            r"ld\.global\.v4\.b32",
            r"st\.global\.v4\.b32",
            r"\.maxntid 128\b",
        ),
        "day012.softmax_rows_kernel.float32.0.1.32.32.128": (r"ld\.global\.b32",),
        "day012.softmax_rows_kernel.float32.0.4.8.512.512": (r"bar\.sync", r"shfl\.sync", r"\.maxntid 512\b"),
        # the looped kernel caches the row's head in dynamic shared memory
        "day012.softmax_looped_kernel.float32.0.4.1024": (
            r"bar\.sync",
            r"\.extern \.shared",
            r"st\.shared\.v4\.b32",
            r"ld\.shared\.v4\.b32",
            r"\.maxntid 1024\b",
        ),
        # long rows split over a thread-block cluster: the cluster shape is compiled into the
        # kernel, the partial (max, sum) pairs travel through distributed shared memory
        # between two cluster barriers
        "day012.softmax_cluster_kernel.float32.0.4.512.8": (
            r"\.reqnctapercluster 8, 1, 1",
            r"mov\.u32\s+%r\d+, %cluster_ctarank;",
            r"barrier\.cluster\.arrive",
            r"barrier\.cluster\.wait",
            r"mapa\.shared::cluster\.u32",
            r"ld\.shared::cluster\.v2\.b32",
        ),
        "day012.softmax_backward_cluster_kernel.float32.0.4.512.2": (
            r"\.reqnctapercluster 2, 1, 1",
            r"barrier\.cluster\.arrive",
            r"mapa\.shared::cluster\.u32",
            r"ld\.shared::cluster\.b32",
        ),
    },
    "day013": {
        # a warp per row: butterfly shuffles and 16-byte loads (no block barrier: checked below)
        "day013.layer_norm_fwd_kernel.float32.float32.4.32.8.8": (r"shfl\.sync\.bfly", r"ld\.global\.v4\.b32"),
        # day 020's fused form: 4 float32 of x and 4 bf16 of delta (8 bytes) per load
        "day013.layer_norm_fwd_kernel.float32.bfloat16.4.32.8.8": (r"ld\.global\.v4\.b32", r"ld\.global\.v4\.b16"),
        "day013.layer_norm_fwd_kernel.bfloat16.bfloat16.8.256.4.1": (
            r"shfl\.sync\.bfly",
            r"bar\.sync",
            r"ld\.global\.v4\.b32",
        ),
        "day013.layer_norm_fwd_stream_kernel.float32.float32.4.512": (
            r"shfl\.sync\.bfly",
            r"bar\.sync",
            r"ld\.global\.v4\.b32",
        ),
        # the backward keeps its rows in dynamic shared memory for the weight/bias partials
        "day013.layer_norm_bwd_kernel.*.float32.*.32.8.8": (
            r"shfl\.sync\.bfly",
            r"bar\.sync",
            r"ld\.global\.v4\.b32",
            r"\.extern \.shared",
        ),
        "day013.layer_norm_bwd_kernel.float64.float64.float64.2.512.8.1": (
            r"ld\.global\.v2\.b64",
            r"\.extern \.shared",
        ),
        "day013.layer_norm_bwd_stream_kernel.float32.float32.float32.4.512": (r"shfl\.sync\.bfly", r"bar\.sync"),
        "day013.sum_partials_kernel.float32.float32.32.16": (r"bar\.sync",),
    },
    "day014": {
        "day014.*": (r"bar\.sync",),
        # Ampere-style tensor cores: ldmatrix + mma.sync, cp.async with a zero-filling src-size
        "day014.gemm_tc_kernel.bfloat16.*": (
            r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32",
            r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16",
        ),
        "day014.gemm_tc_kernel.float16.*": (r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32",),
        "day014.gemm_wgmma_kernel.*": (
            r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16, %r\d+;",
            # cp.async writes are generic-proxy, wgmma reads async-proxy: the fence between
            r"fence\.proxy\.async\.shared::cta",
            r"wgmma\.fence\.sync\.aligned",
            r"wgmma\.commit_group\.sync\.aligned",
            r"wgmma\.wait_group\.sync\.aligned 1;",
        ),
        "day014.gemm_wgmma_kernel.bfloat16.*.128.128.*": (
            r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16",
        ),
        "day014.gemm_wgmma_kernel.bfloat16.*.128.256.*": (
            r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16",
        ),
        # version 3: TMA tile copies completing on mbarriers, waits on mbarrier phases, the
        # register hand-over between producer and consumer warpgroups, and the tensor maps
        # read from kernel parameter space
        "day014.gemm_tma_kernel.*": (
            r"cp\.async\.bulk\.tensor\.3d\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes",
            r"mbarrier\.arrive\.expect_tx\.shared\.b64",
            r"mbarrier\.try_wait\.parity\.shared::cta\.b64",
            r"setmaxnreg\.inc\.sync\.aligned\.u32 232;",
            r"setmaxnreg\.dec\.sync\.aligned\.u32 40;",
            r"cvta\.param\.u64",
            r"\.maxntid 384",
        ),
        "day014.gemm_tma_kernel.bfloat16.*.128.256.*": (
            r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16",
        ),
        # three consumers (192 x 128, day 019 part 12): 512 threads, registers split 24 / 160
        "day014.gemm_tma_kernel.*.192.128.*": (
            r"\.maxntid 512",
            r"setmaxnreg\.inc\.sync\.aligned\.u32 160;",
            r"setmaxnreg\.dec\.sync\.aligned\.u32 24;",
        ),
        # F32_OUT: a float32 master weight's gradient stored as float32 pairs (8-byte stores;
        # the 16-bit epilogue stores bf16 pairs as single 32-bit words)
        "day014.gemm_tma_kernel.bfloat16.1.0.192.128.1.*": (r"st\.global\.v2\.b32",),
        # float32: 3xTF32 over tf32 planes, k8 per wgmma, the accumulator promoted by float32 adds
        "day014.gemm_tma_kernel.float32.*.128.128.*": (
            r"wgmma\.mma_async\.sync\.aligned\.m64n128k8\.f32\.tf32\.tf32",
            r"wgmma\.wait_group\.sync\.aligned 0;[\s\S]*add\.f32",
        ),
        "day014.gemm_simt_kernel.float64.*": (r"fma\.rn\.f64",),
    },
    "day019": {
        # the 3xTF32 split: hi and lo rounded to tf32; the transposing form through shared memory
        "day019.tf32_split_kernel.*": (r"cvt\.rna\.tf32\.f32",),
        "day019.tf32_split_kernel.0": (r"bar\.sync", r"ld\.shared\.b32"),
        # version 4: persistent (a grid-stride loop over tiles), TMA + mbarriers as version 3,
        # the producer's register hand-over, and one m64nBN wgmma per k16 step per consumer
        "day019.gemm_pingpong_kernel.*": (
            r"%nctaid\.x",
            r"cp\.async\.bulk\.tensor\.3d\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes",
            r"mbarrier\.try_wait\.parity\.shared::cta\.b64",
            r"setmaxnreg\.inc\.sync\.aligned\.u32 232;",
            r"setmaxnreg\.dec\.sync\.aligned\.u32 40;",
        ),
        "day019.gemm_pingpong_kernel.bfloat16.*.64.256.*": (
            r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16",
        ),
        "day019.gemm_pingpong_kernel.float16.*.128.128.*": (
            r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.f16\.f16",
        ),
        # BIAS reads the bias a pair at a time; GELU_GRAD (the MLP backward's) asks L2 for its
        # tile of c before the k-loop and reads it a pair (4 bytes) at a time
        "day019.gemm_pingpong_kernel.bfloat16.0.1.256.128.*.1.0.0.1.1.0.0.[01].[01].0": (r"ld\.global\.v2\.b16",),
        "day019.gemm_pingpong_kernel.bfloat16.0.0.256.128.*.0.0.1.1.1.0.0.[01].0.0": (
            r"prefetch\.global\.L2",
            r"ld\.global\.b32",
        ),
        # clusters of 2: the cluster shape compiled in, A multicast to both CTAs, stages
        # released to both producers through mapa'd remote mbarriers, cluster barriers
        # ... CLUSTER, COOP, SPLIT, F32_OUT, TMA_STORE, C_BLOCKS, EPI_WARPS
        "day019.gemm_pingpong_kernel.*.2.0.0.0.0.0.0": (
            r"\.reqnctapercluster 2, 1, 1",
            r"cp\.async\.bulk\.tensor\.3d\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes\.multicast::cluster",
            r"mapa\.shared::cluster\.u32",
            r"mbarrier\.arrive\.shared::cluster\.b64",
            r"barrier\.cluster\.wait",
        ),
        # the fused GELU: one tanh per element in the epilogue (the SFU's, part 10)
        "day019.gemm_pingpong_kernel.bfloat16.0.1.128.128.*.1.1.*": (r"tanh\.approx\.f32",),
        "day019.gemm_pingpong_kernel.bfloat16.0.1.256.128.*.0.1.0.1.1.0.0.1.0.0": (r"tanh\.approx\.f32",),
        # C_BLOCKS (part 16): c in 16-byte blocks, handed out by a quad transpose, asked of L2 first
        "day019.gemm_pingpong_kernel.*.0.[01].1.0": (r"ld\.global\.v4\.b32", r"shfl\.sync", r"prefetch\.global\.L2"),
        # stream-K's fix-up: stores, a GPU-scope fence, the piece count, reads through L2
        "day019.gemm_pingpong_kernel.*.1.1.1.0.0.0.0": (
            r"fence\.acq_rel\.gpu",
            r"atom\.global\.add\.u32",
            r"ld\.global\.cg\.v4\.f32",
        ),
        # split-K: float32 pairs into the workspace; the second kernel reads 16-byte blocks
        "day019.gemm_pingpong_kernel.*.1.1.2.0.0.0.0": (r"st\.global\.v2\.b32",),
        "day019.split_k_sum_kernel.*": (r"ld\.global\.v4\.b32",),
        # float32 outputs (day 020's weight gradients): the accumulator's pairs stored as
        # they are, 8 bytes a store, evict-first; split-K's sum writes 4 floats a store
        "day019.gemm_pingpong_kernel.*.1.1.0.1.0.0.0": (r"st\.global\.cs\.v2\.f32",),
        "day019.split_k_sum_kernel.*.float32": (r"st\.global\.v4\.b32",),
        # the epilogue through shared memory (part 10): 4-byte shared stores, a proxy fence,
        # then one thread's TMA store, its commit and the wait for its reads
        "day019.gemm_pingpong_kernel.*.1.1.0.0.1.[01].0": (
            r"st\.shared\.u32",
            r"fence\.proxy\.async\.shared::cta",
            r"bar\.sync",
            r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta\.bulk_group",
            r"cp\.async\.bulk\.commit_group",
            r"cp\.async\.bulk\.wait_group\.read 0",
            r"cp\.async\.bulk\.wait_group 0",
        ),
        # GELU on the producer's warps 1-3 (EPI_WARPS, part 22): the tile's copy read 16
        # bytes at a time, the outputs stored 16 bytes at a time, the two hand-off mbarriers
        "day019.gemm_pingpong_kernel.*.1.1.0.0.1.0.1": (
            r"tanh\.approx\.f32",
            r"ld\.shared\.v4\.",
            r"st\.global\.v4\.",
            r"mbarrier\.arrive",
        ),
        # GELU_GRAD's column sums there (part 11): the warp's rows summed by xor shuffles,
        # a row of float32 partials stored 8 bytes a lane
        "day019.gemm_pingpong_kernel.*.1.1.1.0.0.1.0.0": (r"shfl\.sync\.bfly\.b32", r"st\.global\.v2\.b32"),
    },
    "day018": {
        # the forward: Q, K and V through 4-D TMA boxes (head_dim, seq, heads, batch), S = Q K^T
        # from shared memory, O += P V with P in registers (the register-A form: four .b32
        # registers where a descriptor would be), exp2, row maxima by butterfly shuffles
        "day018.attention_fwd_kernel.*": (
            r"cp\.async\.bulk\.tensor\.4d\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes",
            r"mbarrier\.try_wait\.parity\.shared::cta\.b64",
            r"ex2\.approx",
            r"shfl\.sync\.bfly\.b32",
        ),
        # head_dim 128: two consumers (384 threads, registers 40 / 232)
        "day018.attention_fwd_kernel.*.128.128.*": (
            r"setmaxnreg\.inc\.sync\.aligned\.u32 232;",
            r"setmaxnreg\.dec\.sync\.aligned\.u32 40;",
            r"\.maxntid 384",
        ),
        # head_dim 64: three consumers (512 threads, registers 24 / 160)
        "day018.attention_fwd_kernel.*.64.128.*": (
            r"setmaxnreg\.inc\.sync\.aligned\.u32 160;",
            r"setmaxnreg\.dec\.sync\.aligned\.u32 24;",
            r"\.maxntid 512",
        ),
        "day018.attention_fwd_kernel.bfloat16.128.*": (
            r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16\s*\{[^}]*\},\s*%rd",
            r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16\s*\{[^}]*\},"
            r"\s*\{%r\d+, %r\d+, %r\d+, %r\d+\}",
        ),
        "day018.attention_fwd_kernel.float16.64.*": (
            r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.f16\.f16\s*\{[^}]*\},\s*\{%r\d+, %r\d+, %r\d+, %r\d+\}",
        ),
        # versions 3 and 4: the consumers' turns through named barriers
        "day018.attention_fwd_kernel.*.[34].[23].*": (r"bar\.sync\s+%r\d+, 256;", r"bar\.arrive\s+%r\d+, 256;"),
        # version 4, persistent: the block walks its work tiles by the grid's size
        "day018.attention_fwd_kernel.*.4.[23].*": (r"mov\.u32\s+%r\d+, %nctaid\.x;",),
        # the backward: the same frame, 64-row streamed tiles (n64 products), P and dS from
        # registers (m64nDk16 register-A), two consumers (keys end in NC, SMEM)
        "day018.attention_bwd_kernel.*": (
            r"cp\.async\.bulk\.tensor\.4d\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes",
            r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.(bf16\.bf16|f16\.f16)\s*\{[^}]*\},\s*%rd",
            r"ex2\.approx",
        ),
        "day018.attention_bwd_kernel.*.*.*.*.*.*.*.*.2.*": (r"\.maxntid 384",),
        # version 7's passes at head_dim 64: three consumers (512 threads) taking turns in a ring
        "day018.attention_bwd_kernel.*.64.4.*.*.0.1.*.3.*": (
            r"\.maxntid 512\n\.minnctapersm 1\n",  # so that ptxas honours setmaxnreg
            r"bar\.sync\s+%r\d+, 256;",
            r"bar\.arrive\s+%r\d+, 256;",
        ),
        # backward versions 3 and 4 (TURNS, either pass): the consumers' turns through named barriers
        "day018.attention_bwd_kernel.*.*.4.*.*.0.1.*": (r"bar\.sync\s+%r\d+, 256;", r"bar\.arrive\s+%r\d+, 256;"),
        # version 5 (OVERLAP): the dQ pass waits for S and dP only, while tile j - 1's dQ
        # product may still run: wait_group 1
        "day018.attention_bwd_kernel.*.*.4.*.1.0.1.1.*": (r"wgmma\.wait_group\.sync\.aligned 1;",),
        # the dK/dV passes (DQ 0): each stage's (lse2, delta) pairs by one plain bulk copy
        "day018.attention_bwd_kernel.*.*.*.*.0.*": (
            r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes"
            r" \[%r\d+\], \[%rd\d+\], %r\d+, \[%r\d+\];",
        ),
        # version 6 (FUSED 2): dQ's 64 x 64 float32 pieces (m64n64 products from shared dS
        # boxes) added by the TMA unit, whose reads of a piece finish before it is rewritten
        "day018.attention_bwd_kernel.*.*.*.*.0.2.0.0.*": (
            r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32 \[%rd\d+\], \[%r\d+\], %r\d+;",
            r"cp\.async\.bulk\.commit_group;",
            r"cp\.async\.bulk\.wait_group\.read 0;",
            r"cp\.async\.bulk\.wait_group 0;",
            r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.(bf16\.bf16|f16\.f16)\s*\{[^}]*\},\s*%rd\d+,\s*%rd",
        ),
        # at head_dim 128 the consumers share dS: a barrier over both, 3 K/Q stages
        "day018.attention_bwd_kernel.*.128.3.*.0.2.0.0.*": (r"bar\.sync\s+%r\d+, 256;",),
        # version 8: the dQ pass in a persistent grid (one block per SM: setmaxnreg holds),
        # walking its work tiles by the grid's size, in turns, overlapped (wait_group 1)
        "day018.attention_dq_persistent_kernel.*": (
            r"\.minnctapersm 1\n",
            r"mov\.u32\s+%r\d+, %nctaid\.x;",
            r"cp\.async\.bulk\.tensor\.4d\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes",
            r"bar\.sync\s+%r\d+, 256;",
            r"wgmma\.wait_group\.sync\.aligned 1;",
            r"ex2\.approx",
        ),
        "day018.attention_bwd_kernel.bfloat16.128.*": (
            r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16\s*\{[^}]*\},"
            r"\s*\{%r\d+, %r\d+, %r\d+, %r\d+\}",
        ),
    },
    "day015": {
        "day015.online_partials_kernel.*": (r"shfl\.sync", r"bar\.sync"),
        "day015.normalize_kernel.*": (r"shfl\.sync", r"bar\.sync"),
        "day015.reduce_*_kernel.*": (r"shfl\.sync", r"bar\.sync"),
        "day015.exp_sum_kernel.*": (r"shfl\.sync", r"bar\.sync"),
        # 16-byte loads, four unrolled back to back (day015's pitfall: a branch between them
        # serialised them)
        "day015.*_kernel.float32.4.*": (r"(?:ld\.global\.v4\.b32[^\n]*\n\s*){4}",),
        "day015.*_kernel.float64.2.*": (r"(?:ld\.global\.v2\.b64[^\n]*\n\s*){4}",),
    },
    "day020": {
        # forward: one block per row, 16-byte loads of the logits, the (max, sum) pairs
        # merged by shuffles and one barrier, a float64 loss and lse per row
        "day020.cross_entropy_kernel.bfloat16.8.256": (
            r"ld\.global\.v4\.b32",
            r"shfl\.sync\.bfly\.b32",
            r"bar\.sync",
            r"st\.global\.b64",
            r"\.maxntid 256\b",
        ),
        "day020.cross_entropy_kernel.float32.4.256": (r"ld\.global\.v4\.b32", r"\.maxntid 256\b"),
        # backward: a stream of 16-byte loads and stores, four loads per thread and
        # iteration (each behind its bounds check: measured at 93% of copy bandwidth anyway)
        "day020.cross_entropy_backward_kernel.bfloat16.8.1024": (
            r"(?:ld\.global\.v4\.b32[\s\S]*?){4}",
            r"st\.global\.v4\.b32",
            r"\.maxntid 1024\b",
        ),
        # one pass: the row copied to shared memory on the way in, read back from it for
        # the gradient; the in-place scale is a stream of 16-byte loads and stores
        "day020.cross_entropy_with_grad_kernel.bfloat16.8.1024": (
            r"st\.shared\.v4\.b32",
            r"ld\.shared\.v4\.b32",
            r"st\.global\.v4\.b32",
            r"bar\.sync",
            r"\.maxntid 1024\b",
        ),
        "day020.scale_unless_one_kernel.bfloat16.8.256.*": (r"ld\.global\.v4\.b32", r"st\.global\.v4\.b32"),
        # the small kernels (part 12): one block, eight loads in flight per thread, a block
        # reduction; the loss is cast from float64 once
        "day020.target_stats_kernel.1024": (
            r"(?:ld\.global\.b64[\s\S]*?){8}",
            r"shfl\.sync\.bfly\.b32",
            r"\.maxntid 1024\b",
        ),
        "day020.sum_rows_kernel.bfloat16.1024": (r"(?:ld\.global\.b64[\s\S]*?){8}", r"cvt\.rn\.bf16\.f64"),
    },
}
# day -> {kernel-key glob: PTX regexes that must NOT appear}
PTX_ABSENT: dict[str, dict[str, tuple[str, ...]]] = {  # a warp per row needs no block barrier
    "day012": {"day012.softmax_rows_kernel.float32.0.4.8.32.128": (r"bar\.sync",)},
    "day013": {"day013.layer_norm_fwd_kernel.float32.*.4.32.8.8": (r"bar\.sync",)},
    # backward version 1 (neither FUSED nor TURNS): its consumers take no turns
    "day018": {"day018.attention_bwd_kernel.*.*.4.*.*.0.0.*": (r"bar\.arrive",)},
    "day019": {
        # no GELU, no GELU_GRAD compiled in (keys end in BIAS, GELU, GELU_GRAD, CLUSTER, COOP,
        # SPLIT, F32_OUT, TMA_STORE, C_BLOCKS, EPI_WARPS)
        "day019.gemm_pingpong_kernel.bfloat16.0.0.64.256.*.0.0.0.1.0.0.0.0.0.0": (r"tanh\.approx",),
        "day019.gemm_pingpong_kernel.*.1.1.0.[01].[01].[01].0": (
            r"atom\.global",
        ),  # whole tiles: no fix-up compiled in
        # float32 outputs: no quad transpose into 16-byte bf16 blocks
        "day019.gemm_pingpong_kernel.*.1.1.0.1.0.0.0": (r"st\.global\.v4", r"shfl\.sync"),
        # GELU_GRAD multiplies by the saved derivative: no exp left in the backward's epilogue
        "day019.gemm_pingpong_kernel.bfloat16.0.0.256.128.*.0.0.1.1.1.0.0.[01].0.0": (r"tanh\.approx", r"ex2\.approx"),
        "day019.gemm_pingpong_kernel.*.1.1.2.0.0.0.0": (r"atom\.global", r"fence\.acq_rel"),  # split-K: none needed
        # TMA stores the output: no global store left in the kernel, no quad transpose
        # (GELU_GRAD's kernels store their column sums: only their 8-byte partials;
        # C_BLOCKS' transpose its c, not the output)
        "day019.gemm_pingpong_kernel.*.0.1.1.0.0.1.0.0": (r"st\.global", r"shfl\.sync"),
        "day019.gemm_pingpong_kernel.*.0.1.1.0.0.1.1.0": (r"st\.global",),
        "day019.gemm_pingpong_kernel.*.1.1.1.0.0.1.0.0": (r"st\.global\.v4", r"st\.global\.b", r"shfl\.sync\.idx"),
        # EPI_WARPS: the epilogue warps store with plain 16-byte stores, no TMA store, and
        # the consumers hand over rounded values (no quad transpose)
        "day019.gemm_pingpong_kernel.*.0.1.1.0.0.1.0.1": (
            r"cp\.async\.bulk\.tensor\.3d\.global\.shared",
            r"shfl\.sync",
        ),
        # C_BLOCKS: no 2-byte loads of c left
        "day019.gemm_pingpong_kernel.*.0.[01].1.0": (r"ld\.global\.b16",),
        "day019.tf32_split_kernel.1": (r"bar\.sync",),  # k-major already: no transpose
    },
    # the forward writes no gradient (no 16-byte global stores), the backward merges nothing
    "day020": {
        "day020.cross_entropy_kernel.float32.4.256": (r"st\.global\.v4",),
        "day020.cross_entropy_backward_kernel.float32.4.256": (r"bar\.sync", r"shfl\.sync"),
    },
}


@pytest.fixture(scope="module")
def builds():
    return gpu_build.build()


def _ptx(path, pattern: str) -> str:
    files = [p for p in sorted(path.glob("*.ptx")) if fnmatch.fnmatch(p.stem, pattern)]
    assert files, f"no kernel in {path.name} matches {pattern!r}"
    return "\n".join(p.read_text() for p in files)


@pytest.mark.parametrize("day", sorted(PTX_FEATURES))
def test_ptx_has_the_instructions_the_day_relies_on(builds, day):
    for pattern, features in PTX_FEATURES[day].items():
        ptx = _ptx(builds[day], pattern)
        assert ".target sm_90a" in ptx
        for feature in features:
            assert re.search(feature, ptx), f"{day} {pattern}: no match for {feature!r} in the PTX"


@pytest.mark.parametrize("day", sorted(PTX_ABSENT))
def test_ptx_lacks_what_the_design_avoids(builds, day):
    for pattern, features in PTX_ABSENT[day].items():
        ptx = _ptx(builds[day], pattern)
        for feature in features:
            assert not re.search(feature, ptx), f"{day} {pattern}: {feature!r} should not be in the PTX"


def test_every_mojo_day_has_gpu_kernels_and_ptx_checks():
    days = {p.parent.name for p in (REPO_ROOT / "days").glob("day*/*.mojo") if p.name != "__init__.mojo"}
    declared = {k.family.module.split(".")[1] for k in all_kernels()}
    assert days <= declared, f"days with Mojo kernels but no declared GPU kernels: {sorted(days - declared)}"
    assert days <= set(PTX_FEATURES), f"days without PTX feature checks: {sorted(days - set(PTX_FEATURES))}"


def test_entry_directives_go_after_the_entrys_maxntid():
    """The build adds a family's entry directives (`.minnctapersm 1` for day 018's
    three-consumer passes) right after `.maxntid`, and refuses PTX without exactly one."""
    from pytorch_custom_ops.attention_gpu import BWD_KERNEL
    from pytorch_custom_ops.library import KernelBuildError

    ptx = ".visible .entry k(\n\t.param .u64 p\n)\n.maxntid 512\n{\n\tret;\n}\n"
    assert gpu_build.with_entry_directives(ptx, ()) == ptx
    got = gpu_build.with_entry_directives(ptx, (".minnctapersm 1",))
    assert got == ptx.replace(".maxntid 512\n", ".maxntid 512\n.minnctapersm 1\n")
    with pytest.raises(KernelBuildError, match="0 `.maxntid` lines"):
        gpu_build.with_entry_directives(ptx.replace(".maxntid 512\n", ""), (".minnctapersm 1",), "k")
    three = [k for k in BWD_KERNEL.kernels() if k.params[-2] == 3]
    assert three and all(k.entry_directives == (".minnctapersm 1",) for k in three)
    assert all(k.entry_directives == () for k in BWD_KERNEL.kernels() if k.params[-2] == 2)
