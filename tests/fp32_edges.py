"""float32 values where codecs go wrong first (signed zeros, rounding ties, subnormals, the
smallest normal), for tests and the GPU checks that put them ahead of random values."""

from __future__ import annotations

NAN, INF = float("nan"), float("inf")
EDGES = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    0.75,
    -0.3,
    1e-3,
    1 - 2**-24,
    1 + 2**-23,
    2.0,
    -3.5,
    2.0**-126,
    -1.5 * 2**-126,
    2.0**-126 - 2.0**-149,
    1e-40,
    -(2.0**-149),
    3 * 2.0**-149,
    2.0**-100 * (1 + 2**-23),
    2.0**-100 * (1 - 2**-24),
    -(2.0**-60),
    2.0**-127,
]
NON_FINITE = [NAN, INF, -INF]
