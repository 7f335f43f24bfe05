"""What every generation body holds, whatever its protocol (read by duo.api.serving.read): the sampling, grammar,
stop and llama-server fields, and their translation into duo's CompletionRequest."""

from __future__ import annotations

import logging
import math
import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from duo.api.serving.limits import INT32_MAX, Int32
from duo.api.serving.request import BadRequest, CompletionRequest
from duo.api.serving.sampler_fields import SamplerFields, check_chain
from duo.constraint import GrammarSpec
from duo.sampling.ops.penalties import MAX_BIAS, Penalties, summed_biases

log = logging.getLogger("duo.http")


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema (what the SDK's parse() sends for a Pydantic model)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # either way the output matches the schema: masking is never best-effort


class ResponseFormat(BaseModel):
    """OpenAI's response_format; llama-server also takes a `schema` beside type json_object."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    def grammar(self) -> GrammarSpec | None:
        if self.type == "text":
            return None
        if self.type == "json_object":  # any JSON object, or llama-server's schema for it
            return GrammarSpec("json_schema", self.schema_ or {"type": "object"}, "response_format")
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise BadRequest("response_format of type json_schema needs json_schema.schema: the JSON schema the "
                             "answer must match", param="response_format.json_schema")
        return GrammarSpec("json_schema", self.json_schema.schema_, "response_format.json_schema.schema")


MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
# A logit_bias key that names a token id (as llama-server's strtol reads a whole key), not a text.
WHOLE_NUMBER = re.compile(r"\s*[+-]?[0-9]+")
LLAMA_DEFAULT_SEED = 2**32 - 1  # llama.cpp's "draw a random seed"
# Fields that change nothing duo returns, ignored without a word (OpenAI's bookkeeping and routing, llama-server's
# slot options, return_progress where no stream of duo's tells it, its own speculation settings: duo's speculation
# is exact whatever they say).
IGNORED_FIELDS = frozenset({"user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier",
                            "id_slot", "return_progress", "return_tokens", "n_keep", "n_discard",
                            "speculative.n_max", "speculative.n_min", "speculative.p_min"})
# Fields llama-server reads that duo cannot honour: refused by name when set (a false, empty or null value asks for
# nothing and passes), with what to do instead.
UNHONOURED = {
    "lora": "duo-target serves its model without LoRA adapters; leave it out",
    "grammar_lazy": "a grammar applies from the first token in duo, not from a trigger; leave it out",
    "grammar_triggers": "a grammar applies from the first token in duo, not from a trigger; leave it out",
    "image_data": "duo-target reads text only; send the request without images",
    "multimodal_data": "duo-target reads text only; send the request without images or audio",
}
# llama-server's `samplers`: the sampler chain in turn, as names (llama.cpp's, any case, with their kebab-case and
# no-dash spellings and three old aliases) or a string of their one-letter codes; a sampler left out is off
# (temperature: 1). Without the list, llama.cpp's default chain: "edskypmxt". duo.sampling.chain runs it in that turn.
_SAMPLER_CODES = {"dry": "d", "top_k": "k", "top_p": "p", "top_n_sigma": "s", "typ_p": "y", "min_p": "m",
                  "temperature": "t", "xtc": "x", "infill": "i", "penalties": "e", "adaptive_p": "a"}
SAMPLERS = {**_SAMPLER_CODES, **{name.replace("_", "-"): code for name, code in _SAMPLER_CODES.items()},
            **{name.replace("_", ""): code for name, code in _SAMPLER_CODES.items()},
            "nucleus": "p", "temp": "t", "typ": "y"}
DEFAULT_SAMPLERS = "edskypmxt"


class LlamaServerFields(BaseModel):
    """A body part as llama-server reads it: a field it does not read is ignored (logged once per name: clients
    send fields of other servers freely); a field it reads that duo cannot honour is refused by name
    (check_fields), never dropped (that would change the answer without telling the client)."""

    # inf and NaN are no numbers a field can take (JSON has none: Python's parser reads 1e400 as inf).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def check_fields(self, where: str = "") -> None:
        for name, value in (self.model_extra or {}).items():
            refusal = UNHONOURED.get(name)
            if refusal is not None and value not in (None, False, [], {}, ""):
                raise BadRequest(f"{where}{name}: {refusal}", param=f"{where}{name}")
            if name not in IGNORED_FIELDS:
                _log_ignored(f"the field {where}{name}")


def _log_ignored(what: str) -> None:
    """Log once that `what` (a field or sampler name) is ignored. Only its first LOGGED_NAME_LENGTH characters are
    logged and kept: a name can be as long as a body, and the set lives as long as the process."""
    clipped = what[:LOGGED_NAME_LENGTH]
    if clipped not in _ignored_seen and len(_ignored_seen) < MAX_LOGGED_FIELDS:
        _ignored_seen.add(clipped)
        log.info("ignoring %s: neither duo-target nor llama-server reads it (logged once)", clipped)


# Names already logged as ignored (clipped); bounded, so that a client sending ever-new names cannot grow it.
_ignored_seen: set[str] = set()
MAX_LOGGED_FIELDS = 1024
LOGGED_NAME_LENGTH = 120


class GenerationBody(LlamaServerFields, SamplerFields):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    LIMIT_NAMES: ClassVar[tuple[str, ...]] = ("max_tokens",)  # the token limit's names, the first taken first
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # -1: until the end of generation or the context
    n_predict: int | None = Field(default=None, ge=-1, le=INT32_MAX)   # llama-server's name for it
    temperature: float | None = None  # left out: the server's default (ServerDefaults: llama-server's 0.8)
    top_p: float | None = None
    top_k: Int32 | None = None        # not OpenAI's, but vLLM's and llama.cpp's
    min_p: float | None = None        # likewise
    seed: int | None = None
    stop: str | list[str] | None = None
    n: Int32 | None = None
    n_cmpl: Int32 | None = None  # llama-server's name for n
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n_probs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)  # llama-server's: > 0 reports logprobs
    post_sampling_probs: bool = False  # llama-server's: the probabilities after the whole sampler chain (prob)
    repeat_penalty: float | None = None  # llama-server's
    repeat_last_n: Int32 | None = None   # llama-server's: -1 the whole output
    # OpenAI's {"token id": bias}; llama-server's [[token id, bias or false], ...] too (false: never), and text in
    # place of an id in either (its every token biased). Its entries are checked one by one in _biases, in Python:
    # pydantic checks a list in one call that lets no other thread run (150k entries: 0.8 s with the event loop
    # stopped).
    logit_bias: dict[str, Any] | list[Any] | None = None
    user: str | None = None
    cache_prompt: bool = True         # llama-server's: false shares no prompt prefix with other requests
    response_format: ResponseFormat | None = None
    grammar: str | None = None        # llama-server's: a GBNF grammar the output must match
    json_schema: dict[str, Any] | None = None  # llama-server's: a JSON schema the output must match
    samplers: list[str] | str | None = None  # llama-server's: which samplers are on (SAMPLERS)
    ignore_eos: bool = False          # llama-server's: never end the answer with an end-of-generation token
    duo_sources: bool = False         # duo's: each streamed chunk says where its text came from (duo.api.serving.decode)
    timings_per_token: bool = False   # llama-server's: each streamed event carries the timings so far
    return_progress: bool = False     # llama-server's: a stream tells how far its prompt's read got (prompt_progress)
    verbose: bool = False             # llama-server's: a whole OpenAI answer carries its native one as __verbose

    @field_validator("seed")
    @classmethod
    def _random_seed(cls, seed: int | None) -> int | None:
        """llama.cpp's -1 (its default seed, 2^32 - 1, as it reads -1) asks for a fresh random seed: as none."""
        return None if seed in (-1, LLAMA_DEFAULT_SEED) else seed

    def check_supported(self) -> None:
        """Refuse, naming the field, what duo cannot do rather than silently ignoring it."""
        self.check_fields()

    def choice_count(self, parallel: int) -> int:
        """How many choices to generate (n, or n_cmpl): at most duo-target's --parallel, each a request of its own."""
        if self.n is not None and self.n_cmpl is not None and self.n != self.n_cmpl:
            raise BadRequest(f"n ({self.n}) and n_cmpl ({self.n_cmpl}) differ: send one of them", param="n_cmpl")
        n = self.n if self.n is not None else self.n_cmpl if self.n_cmpl is not None else 1
        if not 1 <= n <= parallel:
            raise BadRequest(f"n must be between 1 and {parallel} (duo-target's --parallel: each choice runs as a "
                             f"request of its own), got {n}", param="n" if self.n is not None else "n_cmpl")
        return n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def token_limit(self) -> int:
        """The most tokens to generate: the first of LIMIT_NAMES (max_tokens and its aliases, in order) that the
        client set, then n_predict; -1 or none of them: until the end of generation or the context (0 here). A
        warm-up (0) reads its prompt with one token, which its answer drops."""
        asked = self._asked_limit()
        if asked is None:
            return type(self).model_fields[self.LIMIT_NAMES[0]].default or 0
        return 1 if asked == 0 else max(asked, 0)

    @property
    def warm_up(self) -> bool:
        """A token limit of 0 (editors' and llama.vim's warm-ups): as llama-server, the prompt is read into the
        cache, so that the next request with its prefix starts at once, and nothing is generated."""
        return self._asked_limit() == 0

    def _asked_limit(self) -> int | None:
        for name in (*self.LIMIT_NAMES, "n_predict"):
            value = getattr(self, name)
            if name in self.model_fields_set and value is not None:
                return value
        return None

    def penalties(self, bias: tuple[tuple[int, float], ...]) -> Penalties:
        """The request's logit transforms with its token ids' `bias` (checked against the vocabulary when the request
        is prepared)."""
        return Penalties(presence=self.presence_penalty or 0.0, frequency=self.frequency_penalty or 0.0,
                         repeat=1.0 if self.repeat_penalty is None else self.repeat_penalty,
                         repeat_last_n=Penalties.repeat_last_n if self.repeat_last_n is None else self.repeat_last_n,
                         bias=bias)

    def _biases(self) -> tuple[tuple[tuple[int, float], ...], tuple[tuple[str, float], ...]]:
        """logit_bias as llama-server reads it: token ids with their biases (a token named twice gets both), and
        texts whose every token gets the text's bias once the request is prepared (duo.api.serving.prepare). An
        object's key is an id where it is a whole number, else a text; in a list of pairs, an integer is an id and a
        string a text (digits too)."""
        keyed = isinstance(self.logit_bias, dict)
        pairs = self.logit_bias.items() if keyed else self.logit_bias or []
        ids: list[tuple[int, float]] = []
        texts: list[tuple[str, float]] = []
        for pair in pairs:
            key, value = pair if isinstance(pair, (list, tuple)) and len(pair) == 2 else (None, None)
            if keyed and WHOLE_NUMBER.fullmatch(key):
                ids.append((_token_id(key), _bias_value(value)))
            elif isinstance(key, str):
                texts.append((key, _bias_value(value)))
            elif isinstance(key, int) and not isinstance(key, bool):
                ids.append((key, _bias_value(value)))
            else:
                raise BadRequest(f"logit_bias takes token ids or texts with their biases (or false), got {pair!r:.80}",
                                 param="logit_bias")
        return summed_biases(ids), tuple(texts)

    def completion_request(self, *, max_tokens: int | None, **prompt: Any) -> CompletionRequest:
        on = self.samplers_on()
        # Left out of `samplers`, temperature does not scale (1), unless the client asked for greedy outright.
        temperature = 1.0 if self.temperature is None or ("t" not in on and self.temperature != 0) \
            else self.temperature
        params = self.sampling_params(on, temperature=temperature, top_k=(self.top_k or 0) if "k" in on else 0,
                                      top_p=1.0 if self.top_p is None or "p" not in on else self.top_p,
                                      min_p=(self.min_p or 0.0) if "m" in on else 0.0)
        bias, bias_texts = self._biases()  # one walk of a list a client may make 150k entries long
        penalties = self.sampler_penalties(self.penalties(bias) if "e" in on else Penalties(bias=bias), on)
        check_chain(on, params, penalties, self.model_extra or {})
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        # A warm-up's one token is dropped: no logprobs to read. Its grammar is compiled all the same: a schema that
        # cannot be is a 400 there too, as llama-server checks it before reading the prompt.
        warm_up = self.warm_up
        return CompletionRequest(max_tokens=max_tokens or 0, params=params, seed=self.seed, stop=stop,
                                 cache_prompt=self.cache_prompt, grammar=self.grammar_spec(),
                                 warm_up=warm_up, penalties=penalties, bias_texts=bias_texts,
                                 logprobs=-1 if warm_up else self.logprob_count(), infill_sampler="i" in on,
                                 post_sampling_probs=self.post_sampling_probs,
                                 ignore_eos=self.ignore_eos, progress=bool(self.stream and self.return_progress),
                                 **prompt)

    def samplers_on(self) -> str:
        """The codes (SAMPLERS) of the samplers the request turns on: llama-server's default chain (all of them but
        infill) without `samplers`. A name or letter duo does not know is skipped, as llama-server skips it
        (SillyTavern lists tfs_z, which llama.cpp no longer has)."""
        if self.samplers is None:
            return DEFAULT_SAMPLERS
        names = self.samplers
        codes = list(names) if isinstance(names, str) else [SAMPLERS.get(name.lower()) for name in names]
        known = set(SAMPLERS.values())
        for name, code in zip(names, codes):
            if code not in known:
                _log_ignored(f"the sampler {name!r} in samplers")
        return "".join(code for code in codes if code in known)

    def logprob_count(self) -> int:
        """How many alternatives each token's logprobs show (-1: no logprobs): llama-server's n_probs here."""
        return self.n_probs if self.n_probs else -1

    def grammar_spec(self) -> GrammarSpec | None:
        """The one grammar the output must match, from whichever field holds it; BadRequest for two."""
        given = [spec for spec in (self.response_format.grammar() if self.response_format else None,
                                   GrammarSpec("gbnf", self.grammar, "grammar") if self.grammar else None,
                                   GrammarSpec("json_schema", self.json_schema, "json_schema")
                                   if self.json_schema is not None else None) if spec is not None]
        if len(given) > 1:
            raise BadRequest(f"send one of response_format, grammar and json_schema, not {len(given)} of them",
                             param=given[1].param)
        return given[0] if given else None


def _token_id(key: str) -> int:
    """An object key of logit_bias read as the token id it spells; past Python's 4300 digits int() refuses (no token
    id comes near: the vocabulary check would refuse it anyway)."""
    try:
        return int(key)
    except ValueError:
        raise BadRequest(f"logit_bias names token {key.strip()[:40]}..., outside any vocabulary",
                         param="logit_bias") from None


def _bias_value(value: Any) -> float:
    """A logit_bias value as a float: false is -inf (never); a number must be within MAX_BIAS (checked here: an
    integer of hundreds of digits has no float)."""
    if value is False:
        return -math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -MAX_BIAS <= value <= MAX_BIAS:
        raise BadRequest(f"logit_bias values are numbers between -{MAX_BIAS:g} and {MAX_BIAS:g} (or false: never), "
                         f"got {value!r:.40}", param="logit_bias")
    return float(value)
