"""How a request samples: temperature and llama.cpp's truncations and samplers, checked against what the wire carries."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from duo.sampling.ops.infill import MAX_CANDIDATES, InfillVocab

# The wire's limits (proto/duo.proto's SamplingParams: float and int32 fields).
_INT32_MAX = 2**31 - 1
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32, ~1.2e-38
_FLOAT32_BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))  # 1 - 2^-24
MAX_FLOAT_FIELD = 1e6  # a bound on the unbounded float fields (top_n_sigma, tau, ...): far past any use, within float32
# llama.cpp's sampler chain as its sampling_seq letters, the steps a row's distribution takes in turn (penalties e and
# DRY d come first, in duo.sampling.rows): s top-n-sigma, k top-k, y typical, p top-p, m min-p, x xtc, t temperature
# (dynatemp where its range is set), i infill. Its default (common.h) takes the temperature last.
DEFAULT_ORDER = "skypmxti"  # infill last: on only where a vocabulary is given (llama.cpp's default has none)
ORDER_CODES = frozenset("skypmxti")
MAX_ORDER = 64  # the API's bound on `samplers` (duo.api.serving.limits.MAX_SAMPLERS)


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a distribution (duo.sampling.distributions.distribution says in which order).

    vLLM's v1 sampler applies min-p before top-k/top-p instead; the two orders only
    differ when top-p and min-p are both on (min-p first shrinks top-p's nucleus).
    Each field off by default, at llama-server's default value where it has one.
    """

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    infill: InfillVocab | None = None  # llama.cpp's infill sampler last (duo.sampling.ops.infill): the vocabulary it reads
    typical_p: float = 1.0  # 1 = off: locally typical sampling (duo.sampling.ops.truncation)
    top_n_sigma: float = -1.0  # <= 0 = off: keep logits within n standard deviations of the top one
    min_keep: int = 0  # top-p, typical, min-p and xtc leave at least this many tokens (0 or 1: at least one)
    xtc_probability: float = 0.0  # 0 = off: the chance of excluding the top choices (duo.sampling.ops.xtc)
    xtc_threshold: float = 0.1    # the probability a top choice reaches; above 0.5: off
    dynatemp_range: float = 0.0   # 0 = off: the temperature moves within T +- range with the entropy
    dynatemp_exponent: float = 1.0
    mirostat: int = 0  # 0 = off, 1 or 2: mirostat v1 or v2 after the temperature (duo.sampling.ops.mirostat)
    mirostat_tau: float = 5.0  # the target surprise, in bits
    mirostat_eta: float = 0.1  # its learning rate
    order: str = DEFAULT_ORDER  # the chain's steps in turn (DEFAULT_ORDER's codes); a step left out does not apply

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain(self) -> bool:
        """Whether nothing but the temperature shapes the distribution: its support is every token."""
        return not (0 < self.top_k or self.top_p < 1 or self.min_p > 0 or self.infill or self.reshaped)

    @property
    def reshaped(self) -> bool:
        """Whether a sampler beyond temperature, top-k, top-p, min-p and infill is on."""
        return (self.typical_p < 1 or self.top_n_sigma > 0 or self.min_keep > 1 or self.xtc_probability > 0
                or self.dynatemp_range > 0 or self.mirostat != 0)

    def start_mu(self) -> float | None:
        """Mirostat's state before the first token: mu = 2 tau, as llama.cpp starts it; None without mirostat."""
        return 2.0 * self.mirostat_tau if self.mirostat else None

    def validate(self) -> None:
        """Raise ValueError naming the out-of-range field, its allowed range, and its value.

        The values must also hold, and keep their meaning, as they travel to the draft: float32
        and int32 in proto/duo.proto. min_p 0.99999999 is 1.0 in float32 (the draft could not
        sample with it), and temperature 1e-50 is 0 (the draft would draft greedily for a
        sampling request), so both are refused here, where the client hears why.
        """
        if self.__dict__.get("_valid"):  # distribution() asks every row; a request's params are checked once
            return
        t, k, p, m = self.temperature, self.top_k, self.top_p, self.min_p
        # Comparisons are written so that NaN fails them; each float64 range is checked before
        # rounding to float32, which could otherwise overflow.
        if not (_is_real(t) and 0 <= t <= 2 and (t == 0 or _float32(t) >= _FLOAT32_TINY)):
            raise ValueError(f"temperature must be between 0 and 2 (0 = greedy; else at least "
                             f"{_FLOAT32_TINY:.2g}, the smallest float32), got {t!r}")
        _check_int("top_k", k, 0, _INT32_MAX, "0 = off; an int32")
        if not (_is_real(p) and 0 < p <= 1 and _float32(p) >= _FLOAT32_TINY):
            raise ValueError(f"top_p must be in (0, 1] (1 = off; at least {_FLOAT32_TINY:.2g}, the smallest "
                             f"float32), got {p!r}")
        if not (_is_real(m) and 0 <= m < 1 and _float32(m) < 1):
            raise ValueError(f"min_p must be in [0, 1) (0 = off; at most {_FLOAT32_BELOW_ONE:.8f}: closer "
                             f"to 1 is 1 in float32), got {m!r}")
        if self.infill is not None and not (0 < k <= MAX_CANDIDATES or t == 0):
            raise ValueError(f"the infill sampler needs top_k from 1 to {MAX_CANDIDATES} before it (it compares "
                             f"every pair of candidates; editors send 40), got top_k {k}")
        self._validate_samplers()
        object.__setattr__(self, "_valid", True)  # not a field: equality, hashing and replace() ignore it

    def _validate_samplers(self) -> None:
        _check_float("typical_p", self.typical_p, 0.0, 1.0, "1 = off")
        _check_float("top_n_sigma", self.top_n_sigma, -MAX_FLOAT_FIELD, MAX_FLOAT_FIELD, "<= 0 = off")
        _check_int("min_keep", self.min_keep, 0, _INT32_MAX, "0 = off")
        _check_float("xtc_probability", self.xtc_probability, 0.0, 1.0, "0 = off")
        _check_float("xtc_threshold", self.xtc_threshold, 0.0, 1.0, "above 0.5 = off")
        _check_float("dynatemp_range", self.dynatemp_range, 0.0, MAX_FLOAT_FIELD, "0 = off")
        _check_float("dynatemp_exponent", self.dynatemp_exponent, 0.0, MAX_FLOAT_FIELD, "1 = linear")
        _check_int("mirostat", self.mirostat, 0, 2, "0 = off, 1 or 2: its version")
        _check_float("mirostat_tau", self.mirostat_tau, 0.0, MAX_FLOAT_FIELD, "bits")
        _check_float("mirostat_eta", self.mirostat_eta, 0.0, MAX_FLOAT_FIELD, "a learning rate")
        if not (isinstance(self.order, str) and len(self.order) <= MAX_ORDER and set(self.order) <= ORDER_CODES):
            raise ValueError(f"order must be at most {MAX_ORDER} of the sampler codes {''.join(sorted(ORDER_CODES))} "
                             f"(llama.cpp's sampling_seq letters), got {self.order!r:.80}")


def _check_float(name: str, value: object, low: float, high: float, meaning: str) -> None:
    if not (_is_real(value) and math.isfinite(value) and low <= value <= high):  # type: ignore[arg-type]
        raise ValueError(f"{name} must be between {low:g} and {high:g} ({meaning}), got {value!r}")


def _check_int(name: str, value: object, low: int, high: int, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer from {low} to {high} ({meaning}), got {value!r}")


def _float32(x: float) -> float:
    """x as the draft receives it: rounded to the nearest float32."""
    return float(np.float32(x))


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
