"""llama-server's sampler fields beyond temperature, top-k, top-p and min-p, as a body reads them (GenerationBody)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from duo.api.serving.limits import Int32
from duo.api.serving.request import BadRequest
from duo.sampling.ops.dry import DEFAULT_BREAKERS, MAX_BREAKER_BYTES, MAX_BREAKERS, Dry
from duo.sampling.ops.penalties import Penalties
from duo.sampling.chain import active_steps
from duo.sampling.params import MAX_FLOAT_FIELD, MAX_ORDER, ORDER_CODES, SamplingParams

Breaker = Annotated[str, Field(min_length=1, max_length=4 * MAX_BREAKER_BYTES)]  # cut to MAX_BREAKER_BYTES later
Bounded = Annotated[float, Field(ge=-MAX_FLOAT_FIELD, le=MAX_FLOAT_FIELD)]


class SamplerFields(BaseModel):
    """The fields, under llama-server's names (null or left out: its default), and the samplers they turn on where
    `samplers` (its codes: duo.api.serving.bodies.SAMPLERS) lists them: y typical, s top-n-sigma, x xtc, d dry; dynatemp
    is the temperature sampler (t). The list's turn is the chain's (SamplingParams.order). Mirostat (1 or 2) replaces them all but the temperature and the logit bias,
    as llama.cpp's chain does. duo.sampling.distributions.distribution says where each applies."""

    model_config = ConfigDict(allow_inf_nan=False)

    typical_p: float | None = Field(default=None, ge=0, le=1)           # 1: off
    top_n_sigma: Bounded | None = None                                   # <= 0: off (llama-server's -1)
    min_keep: Int32 | None = Field(default=None, ge=0)
    xtc_probability: float | None = Field(default=None, ge=0, le=1)     # 0: off
    xtc_threshold: float | None = Field(default=None, ge=0, le=1)       # 0.1; above 0.5: off
    dynatemp_range: float | None = Field(default=None, ge=0, le=MAX_FLOAT_FIELD)  # 0: off
    dynatemp_exponent: float | None = Field(default=None, ge=0, le=MAX_FLOAT_FIELD)  # 1
    mirostat: int | None = Field(default=None, ge=0, le=2)               # 0: off
    mirostat_tau: float | None = Field(default=None, ge=0, le=MAX_FLOAT_FIELD)  # 5
    mirostat_eta: float | None = Field(default=None, ge=0, le=MAX_FLOAT_FIELD)  # 0.1
    dry_multiplier: float | None = Field(default=None, ge=0, le=MAX_FLOAT_FIELD)  # 0: off
    dry_base: Bounded | None = None                                      # 1.75 (below 1: 1.75, as llama-server)
    dry_allowed_length: Int32 | None = Field(default=None, ge=0)         # 2
    dry_penalty_last_n: Int32 | None = Field(default=None, ge=-1)        # -1: the whole context
    # A JSON array of strings; SillyTavern and text-generation-webui send it encoded in one string, read alike.
    dry_sequence_breakers: list[Breaker] | str | None = Field(default=None, min_length=1, max_length=MAX_BREAKERS)

    def sampling_params(self, on: str, *, temperature: float, top_k: int, top_p: float,
                        min_p: float) -> SamplingParams:
        """The request's SamplingParams: duo's four samplers as the body set them, and these where `on` has them."""
        defaults = SamplingParams()
        if self.mirostat:  # llama.cpp's chain is then the temperature and mirostat alone
            return SamplingParams(temperature=temperature, mirostat=self.mirostat,
                                  mirostat_tau=_or(self.mirostat_tau, defaults.mirostat_tau),
                                  mirostat_eta=_or(self.mirostat_eta, defaults.mirostat_eta))
        return SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            order="".join(code for code in on if code in ORDER_CODES),
            typical_p=_or(self.typical_p, defaults.typical_p) if "y" in on else 1.0,
            top_n_sigma=_or(self.top_n_sigma, defaults.top_n_sigma) if "s" in on else defaults.top_n_sigma,
            min_keep=_or(self.min_keep, defaults.min_keep),
            xtc_probability=_or(self.xtc_probability, 0.0) if "x" in on else 0.0,
            xtc_threshold=_or(self.xtc_threshold, defaults.xtc_threshold),
            dynatemp_range=_or(self.dynatemp_range, 0.0) if "t" in on else 0.0,
            dynatemp_exponent=_or(self.dynatemp_exponent, defaults.dynatemp_exponent))

    def sampler_penalties(self, penalties: Penalties, on: str) -> Penalties:
        """`penalties` with DRY where `on` has it; under mirostat the logit bias alone (llama.cpp leaves the
        penalties and DRY out of its chain then)."""
        breakers = self._breakers()  # checked whether DRY is on or not, as llama-server checks them
        if self.mirostat:
            return Penalties(bias=penalties.bias)
        if "d" not in on or not self.dry_multiplier:
            return penalties
        base = _or(self.dry_base, Dry.base)
        return replace(penalties, dry=Dry(
            multiplier=self.dry_multiplier, base=base if base >= 1 else Dry.base,
            allowed_length=_or(self.dry_allowed_length, Dry.allowed_length),
            penalty_last_n=_or(self.dry_penalty_last_n, Dry.penalty_last_n),
            breakers=breakers))

    def _breakers(self) -> tuple[str, ...]:
        """The sequence breakers: llama-server's defaults where none were sent; BadRequest for what is no list of
        non-empty strings."""
        breakers = self.dry_sequence_breakers
        if breakers is None:
            return DEFAULT_BREAKERS
        if isinstance(breakers, str):
            try:
                breakers = json.loads(breakers)
            except ValueError:
                breakers = None
        if (not isinstance(breakers, list) or not 0 < len(breakers) <= MAX_BREAKERS
                or not all(isinstance(b, str) and 0 < len(b) <= 4 * MAX_BREAKER_BYTES for b in breakers)):
            raise BadRequest(f"dry_sequence_breakers must be a non-empty array of at most {MAX_BREAKERS} non-empty "
                             "strings (or one string holding it as JSON)", param="dry_sequence_breakers")
        return tuple(breakers)


def check_chain(on: str, params: SamplingParams, penalties: Penalties, extra: dict[str, Any]) -> None:
    """Refuse, naming `samplers`, a chain duo would not run as llama-server does: duo applies the penalties and DRY
    to whole rows before the chain (duo.sampling.rows, on both sides), so either listed after a sampler that acts
    (a truncation, a temperature other than 1, infill) would change the answer; and adaptive-p, which duo does not
    have, where adaptive_target turns it on (negative, llama-server's default: it samples as without it)."""
    if len(params.order) > MAX_ORDER:
        raise BadRequest(f"samplers lists {len(params.order)} samplers; at most {MAX_ORDER}", param="samplers")
    if params.mirostat:  # llama.cpp's chain is then the temperature and mirostat alone
        return
    acting = set(active_steps(params)) | ({"i"} if "i" in on else set())
    repeats = penalties.presence or penalties.frequency or (penalties.repeat != 1 and penalties.repeat_last_n)
    for place, code in enumerate(on):
        late = (code == "e" and repeats) or (code == "d" and penalties.dry.active)
        if late and acting & set(on[:place]):
            name = "penalties" if code == "e" else "dry"
            raise BadRequest(f"samplers: duo applies {name} before every other sampler; list it first (as "
                             f"llama-server's default order does) or leave the samplers before it off",
                             param="samplers")
    target = extra.get("adaptive_target")
    if "a" in on and isinstance(target, (int, float)) and not isinstance(target, bool) and target >= 0:
        raise BadRequest("samplers: duo-target has no adaptive-p sampler; leave adaptive_p out or adaptive_target "
                         "negative", param="samplers")


def _or(value: float | int | None, default: float | int) -> float | int:
    return default if value is None else value
