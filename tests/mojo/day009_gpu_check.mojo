# Day 009 GPU check: runs OnlineSoftmax.execute on one tensor and compares it with a
# float64 reference computed here on the host.
#   mojo run -I . tests/mojo/day009_gpu_check.mojo                                 (CPU branch)
#   mojo build -I . --target-accelerator nvidia:90 tests/mojo/day009_gpu_check.mojo (GPU binary)
# CI compiles the GPU branch (tests/test_gpu_build.py); the binary runs on the H100 as-is.
from extensibility import InputTensor, OutputTensor, StaticTensorSpec
from max.gpu.host import DeviceContext
from std.math import exp
from std.sys import has_accelerator
from std.utils import IndexList

from days.day009.online_softmax import OnlineSoftmax

comptime Spec = StaticTensorSpec[DType.float32, 2, ...].get_unknown()
comptime ROWS = 67
comptime COLS = 4097  # not a multiple of the block: the tail is exercised


def main() raises:
    comptime target = "gpu" if has_accelerator() else "cpu"
    var ctx = DeviceContext() if has_accelerator() else DeviceContext(api="cpu")
    comptime N = ROWS * COLS
    var host = ctx.enqueue_create_host_buffer[DType.float32](N)
    ctx.synchronize()
    var state: UInt64 = 12345
    for i in range(N):  # a small LCG: values in [-20, 20), never all equal
        state = state * 6364136223846793005 + 1442695040888963407
        host[i] = Float32(Float64(state >> 40) / Float64(1 << 24) * 40.0 - 20.0)
    var d_in = ctx.enqueue_create_buffer[DType.float32](N)
    var d_out = ctx.enqueue_create_buffer[DType.float32](N)
    ctx.enqueue_copy(dst_buf=d_in, src_buf=host)
    ctx.synchronize()
    var shape = IndexList[2](ROWS, COLS)
    OnlineSoftmax.execute[target, BLOCK=256](
        OutputTensor[static_spec=Spec](d_out.unsafe_ptr(), shape),
        InputTensor[static_spec=Spec](d_in.unsafe_ptr(), shape),
        ctx,
    )
    var worst: Float64 = 0
    with d_out.map_to_host() as out:
        for r in range(ROWS):
            var m: Float64 = -1e300
            for c in range(COLS):
                m = max(m, Float64(host[r * COLS + c]))
            var s: Float64 = 0
            for c in range(COLS):
                s += exp(Float64(host[r * COLS + c]) - m)
            for c in range(COLS):
                var want = exp(Float64(host[r * COLS + c]) - m) / s
                worst = max(
                    worst,
                    abs(Float64(out[r * COLS + c]) - want) / (want + 1e-12),
                )
    print(
        "day009 online_softmax on",
        target,
        "rows",
        ROWS,
        "cols",
        COLS,
        "max rel err",
        worst,
    )
    if worst > 1e-5:
        raise Error("day009 gpu_check: max relative error ", worst, " > 1e-5")
    print("OK")
