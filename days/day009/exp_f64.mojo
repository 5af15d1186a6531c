# `exp` for the softmax-family kernels: float64 through `exp_f64` below, every other
# dtype through std.math.exp (unchanged). Mojo 1.2's float64 exp is good to only
# ~3e-13 relative (exp(1) = 2.718281828459813): float64 softmax gradients were ~1e-12
# off, a thousand times torch's float64 error.

from std.math import exp as std_exp, floor, isnan
from std.memory import bitcast

comptime INV_LN2 = 1.4426950408889634
# ln 2 in two parts: k * LN2_HI is exact for |k| < 2^11 (its low 11 bits are zero)
comptime LN2_HI = 0.693147180369123816490
comptime LN2_LO = 1.90821492927058770002e-10
comptime TAYLOR_TERMS = 14  # |r| <= ln2 / 2: r^14 / 14! < 1e-17


@always_inline
def exp(x: SIMD) -> type_of(x):
    comptime if type_of(x).dtype == DType.float64:
        comptime w = type_of(x).length
        return rebind[type_of(x)](exp_f64(rebind[SIMD[DType.float64, w]](x)))
    else:
        comptime assert x.dtype.is_floating_point(), "exp of a float"
        return std_exp(x)


@always_inline
def exp_f64(x: SIMD[DType.float64, _]) -> type_of(x):
    """e^x to ~1 ulp: x = k ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series, then
    two powers of two (each in the normal range, so results down to the subnormals
    round once). Below -745.2 it is 0, above 709.79 inf; NaN stays NaN."""
    comptime V = type_of(x)
    var clamped = min(
        max(x, -746.0), 710.0
    )  # keeps k in range; the ends are set below
    var kf = floor(clamped * INV_LN2 + 0.5)
    var r = (clamped - kf * LN2_HI) - kf * LN2_LO
    var p = V(1.0)
    comptime for i in range(
        TAYLOR_TERMS, 0, -1
    ):  # Horner: 1 + r/1 (1 + r/2 (1 + ...))
        p = p * (r * (1.0 / Float64(i))) + 1.0
    # 2^k as two factors 2^k1 2^k2, k1 = floor(k / 2): each within [-537, 512], so each
    # is a normal float64 built from its exponent bits
    var k = kf.cast[DType.int64]()
    var k1 = k >> 1
    var two_k1 = bitcast[DType.float64, V.length]((k1 + 1023) << 52)
    var two_k2 = bitcast[DType.float64, V.length]((k - k1 + 1023) << 52)
    var y = p * rebind[V](two_k1) * rebind[V](two_k2)
    y = x.lt(-745.2).select(V(0), y)
    y = x.gt(709.79).select(V(Float64.MAX) * 2.0, y)
    return isnan(x).select(
        x, y
    )  # NaN in, NaN out (min/max may have dropped it)
