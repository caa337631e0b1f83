"""Input generators that hit the edges of the quantization rules."""

from __future__ import annotations

import numpy as np

F32_TINY = np.float32(2.0**-126)


def adversarial_matrix(
    rows: int,
    cols: int,
    seed: int,
    *,
    block: int = 32,
    subnormals: bool = False,
    specials: bool = True,
) -> np.ndarray:
    """A float32 (rows, cols) matrix whose blocks of `block` columns each stress one rule.

    Per block: a Gaussian at a random scale (2^-40 .. 2^40); blocks whose max is exactly
    448·2^k, 6·2^k or 57344·2^k, or one ulp either side; E4M3/E2M1 rounding ties; all-zero
    blocks; and (optional) NaN / Inf entries and subnormal values.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    n_blocks = cols // block
    for r in range(rows):
        for b in range(n_blocks):
            sl = slice(b * block, (b + 1) * block)
            kind = rng.integers(0, 9)
            scale = np.float32(2.0 ** rng.integers(-40, 40))
            x[r, sl] *= scale
            if kind == 1:  # max exactly at fmt_max * 2^k, or one ulp around it
                fmt_max = rng.choice([448.0, 6.0, 57344.0, 2688.0])
                peak = np.float32(fmt_max * 2.0 ** rng.integers(-20, 20))
                peak = np.nextafter(peak, np.float32(rng.choice([0, np.inf, peak])))
                x[r, sl] = np.clip(x[r, sl], -abs(peak), abs(peak))
                x[r, b * block + rng.integers(0, block)] = peak * rng.choice([-1, 1])
            elif kind == 2:  # all-zero block (and a negative zero)
                x[r, sl] = 0.0
                x[r, b * block] = -0.0
            elif kind == 3:  # exact ties of the E4M3 / E2M1 grids under a pow2 scale
                grid = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 1.0625, 17.0, 464.0])
                x[r, sl] = rng.choice(grid, block) * scale * rng.choice([-1, 1], block)
            elif kind == 4 and specials:
                x[r, b * block + rng.integers(0, block)] = rng.choice([np.nan, np.inf, -np.inf])
            elif kind == 5 and subnormals:
                x[r, sl] = (rng.standard_normal(block) * 2.0**-130).astype(np.float32)
            elif kind == 6:  # tiny but normal block maxima (subnormal intermediates)
                x[r, sl] = (rng.standard_normal(block) * 2.0 ** rng.integers(-126, -110)).astype(
                    np.float32
                )
                if not subnormals:
                    x[r, sl] = np.where(np.abs(x[r, sl]) < F32_TINY, 0, x[r, sl])
    return x


def has_subnormal(x: np.ndarray) -> bool:
    a = np.abs(x)
    return bool(((a > 0) & (a < F32_TINY)).any())
