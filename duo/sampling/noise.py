"""Coupled sampling's shared noise: one uniform per (seed, position, token), the same on both sides.

Gumbel-max coupling: with g(i) i.i.d. standard Gumbel, argmax_i log p(i) + g(i) is an exact sample
from p. Equivalently (the form computed here), with E(i) = -ln u(i) i.i.d. standard exponential and
g = -ln E, the token is argmax_i p(i) / E(i): the first arrival of an exponential race with rates
p(i). The target's token at a position is that argmax over its own truncated distribution, so it
is a function of (seed, position, target logits) alone; the draft proposes the argmax over its own
q with the same noise, and the target keeps a draft token when it equals its own. Whatever the
draft does, the output is the target's sample: lossless and reproducible by construction.

The noise is part of the protocol (proto/duo.proto, COUPLED, where it is specified), built on
SplitMix64 (Steele, Lea and Flood 2014): u(seed, position, id) = ((splitmix(key, id + 1) >> 11)
+ 0.5) / 2^53 with key = splitmix(mix(seed), position + 1), exact in float64; E = -ln u.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK64 = 2**64 - 1
_BITS = 53  # u's resolution: the top 53 bits of a hash, exact in float64


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _finish(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output mix of each state, in place (uint64 arithmetic wraps mod 2^64, as the spec wants)."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(_MIX1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    return z


def noise_key(seed: int, position: int) -> int:
    return _mix((_mix(seed & _MASK64) + (position + 1) * _GOLDEN) & _MASK64)


def noise_bits(seed: int, position: int, ids: np.ndarray) -> np.ndarray:
    """The 53-bit integers m(id) with u(seed, position, id) = (m + 1/2) / 2^53."""
    z = np.asarray(ids, dtype=np.int64).astype(np.uint64) + np.uint64(1)
    z *= np.uint64(_GOLDEN)
    z += np.uint64(noise_key(seed, position))
    return _finish(z) >> np.uint64(64 - _BITS)


def vocabulary_bits(seed: int, position: int, n_vocab: int) -> np.ndarray:
    """noise_bits for ids 0 .. n_vocab - 1, from a cached (id + 1) * golden: one add and the mix."""
    z = _golden_steps(n_vocab) + np.uint64(noise_key(seed, position))
    return _finish(z) >> np.uint64(64 - _BITS)


@lru_cache(maxsize=4)
def _golden_steps(n_vocab: int) -> np.ndarray:
    steps = np.arange(1, n_vocab + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
    steps.flags.writeable = False
    return steps


def uniforms(seed: int, position: int, ids: np.ndarray) -> np.ndarray:
    """u(seed, position, id) for every id: the protocol's shared noise, in (0, 1)."""
    return uniforms_of(noise_bits(seed, position, ids))


def uniforms_of(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.float64) + 0.5) * 2.0**-_BITS


def lowest_bits_below(exponential: float) -> int:
    """A bar on m below which E = -ln u is surely at least `exponential` (x): E < x needs u > e^-x >= 1 - x,
    so m + 1/2 > (1 - x) 2^53; the bar sits two steps lower for the rounding of (1 - x) 2^53. 0 when x >= 1:
    then nothing is excluded."""
    if exponential >= 1:
        return 0
    return max(math.floor((1.0 - exponential) * 2.0**_BITS) - 2, 0)
