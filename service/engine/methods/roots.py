"""A bracketed Newton iteration for the scalar root searches over a whole network.

Each evaluation of mu_f (TAT Algorithm 1's M_{f, C_a}(0), DKS's M_{f, r_1}(1)) is a pass over the
network, so the number of passes is the cost. Brent's method needs about 12 of them for a
bracket of [0, 1] at 1e-15; Newton's, from a close start, 3 to 5. The derivative comes with the
value from one pass by the complex step (Squire and Trefethen 1998): evaluated at x + i h, a
real-analytic f gives f(x) + i h f'(x) up to O(h^2), so Im f(x + i h) / h is f'(x) to machine
precision with no subtractive cancellation, for h far below x's rounding. Every operation a pass
makes (sums, products, sqrt, arccos) is analytic where it is used.

The iteration keeps a bracket [lo, hi] with a sign change, takes the Newton step when it stays
strictly inside it and bisects otherwise (Numerical Recipes' rtsafe), so it converges wherever
the bracketing search did.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import budget

COMPLEX_STEP = 1e-30


def complex_step(f: Callable[[complex], complex], x: float) -> tuple[float, float]:
    """(f(x), f'(x)) of a real-analytic f from one evaluation at x + i COMPLEX_STEP."""
    v = complex(f(complex(x, COMPLEX_STEP)))
    return v.real, v.imag / COMPLEX_STEP


def newton_bracketed(
    f: Callable[[float], tuple[float, float]],
    lo: float,
    hi: float,
    start: float,
    f_lo: float | None = None,
    xtol: float = 4e-16,
    max_iter: int = 100,
) -> float:
    """A root of f in [lo, hi] (f(lo), f(hi) of opposite signs or zero); f returns (value, slope).
    ``f_lo``: f(lo) when the caller knows it (one pass fewer).

    Stops when the next step moves x by less than ``xtol`` relative (x is then a root to within
    rounding; the closer of x and that step's end is returned) or the value is exactly 0; after
    ``max_iter`` passes it returns the best x seen.
    """
    if f_lo is None:
        f_lo = f(lo)[0]
    if f_lo == 0.0:
        return lo
    x = min(max(start, lo), hi)
    best, best_abs = x, float("inf")
    for _ in range(max_iter):
        budget.check()  # each pass is a network-wide evaluation (engine.budget)
        fx, dfx = f(x)
        if abs(fx) < best_abs:
            best, best_abs = x, abs(fx)
        if fx == 0.0:
            return x
        if (fx < 0.0) == (f_lo < 0.0):
            lo = x
        else:
            hi = x
        step = fx / dfx if dfx != 0.0 else float("inf")
        nxt = x - step
        if abs(step) <= xtol * abs(x):
            # within rounding of the root: one more pass decides which neighbour is closer
            return nxt if abs(f(nxt)[0]) < best_abs else best
        if not (lo < nxt < hi):
            nxt = 0.5 * (lo + hi)
            if hi - lo <= xtol * max(abs(lo), abs(hi)):
                return best
        x = nxt
    return best
