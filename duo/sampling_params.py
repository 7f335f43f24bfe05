"""How a request samples: temperature, top-k, top-p and min-p, checked against what the wire carries."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from duo.infill_sampler import MAX_CANDIDATES, InfillVocab

# The wire's limits (proto/duo.proto's SamplingParams: float and int32 fields).
_INT32_MAX = 2**31 - 1
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32, ~1.2e-38
_FLOAT32_BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))  # 1 - 2^-24


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a distribution: the filters apply in field order.

    vLLM's v1 sampler applies min-p before top-k/top-p instead; the two orders only
    differ when top-p and min-p are both on (min-p first shrinks top-p's nucleus).
    """

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    infill: InfillVocab | None = None  # llama.cpp's infill sampler last (duo.infill_sampler): the vocabulary it reads

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        """Raise ValueError naming the out-of-range field, its allowed range, and its value.

        The values must also hold, and keep their meaning, as they travel to the draft: float32
        and int32 in proto/duo.proto. min_p 0.99999999 is 1.0 in float32 (the draft could not
        sample with it), and temperature 1e-50 is 0 (the draft would draft greedily for a
        sampling request), so both are refused here, where the client hears why.
        """
        t, k, p, m = self.temperature, self.top_k, self.top_p, self.min_p
        # Comparisons are written so that NaN fails them; each float64 range is checked before
        # rounding to float32, which could otherwise overflow.
        if not (_is_real(t) and 0 <= t <= 2 and (t == 0 or _float32(t) >= _FLOAT32_TINY)):
            raise ValueError(f"temperature must be between 0 and 2 (0 = greedy; else at least "
                             f"{_FLOAT32_TINY:.2g}, the smallest float32), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 0 <= k <= _INT32_MAX:
            raise ValueError(f"top_k must be an integer from 0 (off) to {_INT32_MAX} (an int32), got {k!r}")
        if not (_is_real(p) and 0 < p <= 1 and _float32(p) >= _FLOAT32_TINY):
            raise ValueError(f"top_p must be in (0, 1] (1 = off; at least {_FLOAT32_TINY:.2g}, the smallest "
                             f"float32), got {p!r}")
        if not (_is_real(m) and 0 <= m < 1 and _float32(m) < 1):
            raise ValueError(f"min_p must be in [0, 1) (0 = off; at most {_FLOAT32_BELOW_ONE:.8f}: closer "
                             f"to 1 is 1 in float32), got {m!r}")
        if self.infill is not None and not (0 < k <= MAX_CANDIDATES or t == 0):
            raise ValueError(f"the infill sampler needs top_k from 1 to {MAX_CANDIDATES} before it (it compares "
                             f"every pair of candidates; editors send 40), got top_k {k}")


def _float32(x: float) -> float:
    """x as the draft receives it: rounded to the nearest float32."""
    return float(np.float32(x))


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
