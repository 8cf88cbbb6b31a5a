"""Triton helpers shared by the FP8 kernels: round float32 to e4m3 (nearest-even, saturating at 448).

Compiled Triton converts with the hardware's correctly rounded instruction. Triton's
interpreter (3.6) rounds some values wrongly when the mantissa carries into the next
binade (127.9 becomes 64, not 128), so in the interpreter the value is first rounded
to the e4m3 grid in float32 arithmetic (exact: scaling by powers of two), and only
an exactly representable value is then converted.
"""

from __future__ import annotations

import triton
import triton.language as tl

_RINT_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (y + M) - M rounds |y| < 2**22 to nearest-even


@triton.jit
def round_to_e4m3(x, INTERPRETED: tl.constexpr):
    """``x`` (float32, ``|x| <= 448`` up to rounding) as ``float8e4nv``, round-to-nearest-even."""
    if INTERPRETED:
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        bits = x.to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) - 127  # floor(log2 |x|) for a normal float32
        e = tl.maximum(exp, -6) - 3  # the e4m3 grid step is 2**e (subnormals below 2**-6: step 2**-9)
        step = ((e + 127) << 23).to(tl.float32, bitcast=True)
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
        y = x * inv
        y = (y + _RINT_MAGIC) - _RINT_MAGIC
        r = tl.abs(y * step)  # on the e4m3 grid; its e4m3 bits, built by hand (the interpreter's
        rbits = r.to(tl.int32, bitcast=True)  # own conversion also drops the sign of -0)
        normal = ((((rbits >> 23) & 0xFF) - 127 + 7) << 3) | ((rbits >> 20) & 7)
        code = tl.where(r < 0.015625, (r * 512.0).to(tl.int32), normal)
        code = tl.where(bits < 0, code | 0x80, code)
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return x.to(tl.float8e4nv)


__all__ = ["round_to_e4m3"]
