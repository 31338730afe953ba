"""P² (Jain & Chlamtac 1985) restated in float64: smartclip's variant and the textbook
one clipjax uses."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


class P2:
    """P² (Jain & Chlamtac 1985) in float64 Python, one observation at a time.

    ``textbook=False`` is smartclip's ``core/stats.py`` P2Quantile: its parabolic
    step without the ``1/(n[i+1]-n[i-1])`` factor, NaN before 5 observations.
    ``textbook=True`` is clipjax's (a FIX): the textbook formula, and the exact
    median of the observations so far before 5.
    """

    def __init__(self, p: float = 0.5, textbook: bool = True) -> None:
        self.p, self.textbook = p, textbook
        self.xs: list[float] = []
        self.q: list[float] = []
        self.n: list[int] = []
        self.nd: list[float] = []
        self.dn = [0.0, p / 2, p, (1 + p) / 2, 1.0]

    def observe(self, x: float) -> None:
        p, q, n = self.p, self.q, self.n
        if len(self.xs) < 5:
            self.xs.append(float(x))
            if len(self.xs) == 5:
                self.q = sorted(self.xs)
                self.n = [0, 1, 2, 3, 4]
                self.nd = [0.0, 2 * p, 4 * p, 2 + 2 * p, 4.0]
            return
        if x < q[0]:
            q[0], k = x, 0
        elif x < q[1]:
            k = 0
        elif x < q[2]:
            k = 1
        elif x < q[3]:
            k = 2
        elif x <= q[4]:
            k = 3
        else:
            q[4], k = x, 3
        for i in range(k + 1, 5):
            n[i] += 1
        for i in range(5):
            self.nd[i] += self.dn[i]
        for i in range(1, 4):
            d = self.nd[i] - n[i]
            if (d >= 1 and n[i + 1] - n[i] > 1) or (d <= -1 and n[i - 1] - n[i] < -1):
                s = 1 if d >= 1 else -1
                factor = s / (n[i + 1] - n[i - 1]) if self.textbook else s
                qp = q[i] + factor * (
                    (n[i] - n[i - 1] + s) * (q[i + 1] - q[i]) / (n[i + 1] - n[i])
                    + (n[i + 1] - n[i] - s) * (q[i] - q[i - 1]) / (n[i] - n[i - 1])
                )
                if q[i - 1] < qp < q[i + 1]:
                    q[i] = qp
                else:
                    q[i] = q[i] + s * (q[i + s] - q[i]) / (n[i + s] - n[i])
                n[i] += s

    def value(self) -> float:
        if len(self.xs) == 5:
            return self.q[2]
        if not self.textbook or not self.xs:
            return math.nan
        return float(np.median(self.xs))


def p2_restated(xs: Sequence[float], p: float = 0.5, textbook: bool = False) -> np.ndarray:
    """:class:`P2`'s value after each observation of ``xs``."""
    p2 = P2(p, textbook)
    out = []
    for x in xs:
        p2.observe(float(x))
        out.append(p2.value())
    return np.array(out)
