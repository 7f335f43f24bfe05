"""The request bodies of the OpenAI-compatible HTTP API (read by duo.api.parsing) and their translation into duo's
CompletionRequest."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from duo.api.infill import FimInput
from duo.api.limits import INT32_MAX, Int32
from duo.api.requests import BadRequest, CompletionRequest
from duo.constraint import GrammarSpec
from duo.api.tools import FunctionBody, ToolBody, ToolChoice, ToolError, template_message, tool_use
from duo.penalties import MAX_BIAS, Penalties
from duo.sampling import SamplingParams


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
# Fields that change nothing duo returns, so ignoring them is exact (OpenAI's bookkeeping and routing, llama-server's
# slot and progress options); every other field is honoured or refused with a 400 naming it, never dropped.
IGNORED_FIELDS = frozenset({"user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier",
                            "id_slot", "timings_per_token", "return_progress"})
# llama-server's sampling fields at the value that turns them off: sent so (llama.cpp scripts often send every
# field), they change nothing and are honoured; any other value is refused by name.
OFF_VALUES = {"typical_p": 1.0, "mirostat": 0, "tfs_z": 1.0, "dry_multiplier": 0.0,
              "xtc_probability": 0.0, "min_keep": 0}
# llama-server's `samplers`: names (and their one-letter codes, for the string form) of the samplers a request turns
# on; those it leaves out are off (temperature: 1). duo applies them in its own order (duo.sampling.distribution:
# temperature first, as OpenAI and vLLM; llama.cpp's default chain takes it last, which differs only where a
# temperature other than 1 meets top-p or min-p). typ_p, xtc, dry and top_n_sigma are off in duo whatever the list.
SAMPLERS = {"top_k": "k", "top-k": "k", "top_p": "p", "top-p": "p", "nucleus": "p", "min_p": "m", "min-p": "m",
            "temperature": "t", "temp": "t", "infill": "i", "penalties": "e", "typ_p": "y", "typical_p": "y",
            "typical-p": "y", "typ-p": "y", "typ": "y", "xtc": "x", "dry": "d", "top_n_sigma": "s"}


class Fenced(BaseModel):
    """A body part whose fields duo does not know are refused by name (a client's option silently dropped would
    change its answer without telling it): check_fields()."""

    # inf and NaN are no numbers a field can take (JSON has none: Python's parser reads 1e400 as inf).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def check_fields(self, where: str = "") -> None:
        for name, value in (self.model_extra or {}).items():
            off = OFF_VALUES.get(name)
            if name not in IGNORED_FIELDS and not (off is not None and value == off and not isinstance(value, bool)):
                raise BadRequest(f"{where}{name} is not supported by duo-target; leave it out",
                                 param=f"{where}{name}")


class GenerationBody(Fenced):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # -1: until the end of generation or the context
    n_predict: int | None = Field(default=None, ge=-1, le=INT32_MAX)   # llama-server's name for it
    temperature: float | None = None  # OpenAI's default: 1
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
    repeat_penalty: float | None = None  # llama-server's
    repeat_last_n: Int32 | None = None   # llama-server's: -1 the whole output
    # OpenAI's {"token id": bias}; llama-server's [[token id, bias or false], ...] too (false: never). Its entries
    # are checked one by one in _biases, in Python: pydantic checks a list in one call that lets no other thread run
    # (150k entries: 0.8 s with the event loop stopped).
    logit_bias: dict[str, Any] | list[Any] | None = None
    user: str | None = None
    cache_prompt: bool = True         # llama-server's: false shares no prompt prefix with other requests
    response_format: ResponseFormat | None = None
    grammar: str | None = None        # llama-server's: a GBNF grammar the output must match
    json_schema: dict[str, Any] | None = None  # llama-server's: a JSON schema the output must match
    samplers: list[str] | str | None = None  # llama-server's: which samplers are on (SAMPLERS)

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

    def token_limit(self, *names: str) -> int:
        """The most tokens to generate: the first of `names` (max_tokens and its aliases, in order) that the client
        set, then n_predict; -1 or none of them: until the end of generation or the context (0 here)."""
        for name in (*names, "n_predict"):
            value = getattr(self, name)
            if name in self.model_fields_set and value is not None:
                if value == 0:  # /completion answers a warm-up (n_predict 0) before it asks
                    raise BadRequest(f"{name} must be at least 1 (or -1: until the end of generation)", param=name)
                return max(value, 0)
        default = type(self).model_fields[names[0]].default if names else None
        return default or 0

    def penalties(self) -> Penalties:
        """The request's logit transforms (checked against the vocabulary when the request is prepared)."""
        return Penalties(presence=self.presence_penalty or 0.0, frequency=self.frequency_penalty or 0.0,
                         repeat=1.0 if self.repeat_penalty is None else self.repeat_penalty,
                         repeat_last_n=Penalties.repeat_last_n if self.repeat_last_n is None else self.repeat_last_n,
                         bias=self._biases())

    def _biases(self) -> tuple[tuple[int, float], ...]:
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias or []
        biases = {}
        for pair in pairs:
            token, value = pair if isinstance(pair, (list, tuple)) and len(pair) == 2 else (None, None)
            try:
                token = int(token)
            except (TypeError, ValueError, OverflowError):
                raise BadRequest(f"logit_bias takes token ids and their biases (or false), got {pair!r:.80}: "
                                 "tokenize text first (POST /tokenize)", param="logit_bias") from None
            biases[token] = _bias_value(value)
        return tuple(sorted(biases.items()))

    def completion_request(self, *, max_tokens: int | None, **prompt: Any) -> CompletionRequest:
        on = self.samplers_on()
        # Left out of `samplers`, temperature does not scale (1), unless the client asked for greedy outright.
        temperature = 1.0 if self.temperature is None or ("t" not in on and self.temperature != 0) \
            else self.temperature
        params = SamplingParams(temperature=temperature, top_k=(self.top_k or 0) if "k" in on else 0,
                                top_p=1.0 if self.top_p is None or "p" not in on else self.top_p,
                                min_p=(self.min_p or 0.0) if "m" in on else 0.0)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return CompletionRequest(max_tokens=max_tokens or 0, params=params, seed=self.seed, stop=stop,
                                 cache_prompt=self.cache_prompt, grammar=self.grammar_spec(),
                                 penalties=self.penalties() if "e" in on else Penalties(bias=self._biases()),
                                 logprobs=self.logprob_count(), infill_sampler="i" in on, **prompt)

    def samplers_on(self) -> str:
        """The codes (SAMPLERS) of the samplers the request turns on: all of duo's but infill without `samplers`."""
        if self.samplers is None:
            return "kpmte"
        names = self.samplers
        codes = list(names) if isinstance(names, str) else [SAMPLERS.get(name) for name in names]
        unknown = [name for name, code in zip(names, codes) if code not in SAMPLERS.values()]
        if unknown:
            raise BadRequest(f"unknown sampler {unknown[0]!r} in samplers; duo knows {', '.join(SAMPLERS)} "
                             f"(or their letters {''.join(sorted(set(SAMPLERS.values())))})", param="samplers")
        return "".join(codes)

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


def _bias_value(value: Any) -> float:
    """A logit_bias value as a float: false is -inf (never); a number must be within MAX_BIAS (checked here: an
    integer of hundreds of digits has no float)."""
    if value is False:
        return -math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -MAX_BIAS <= value <= MAX_BIAS:
        raise BadRequest(f"logit_bias values are numbers between -{MAX_BIAS:g} and {MAX_BIAS:g} (or false: never), "
                         f"got {value!r:.40}", param="logit_bias")
    return float(value)


class CompletionBody(GenerationBody):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(default=16, ge=-1, le=INT32_MAX)  # OpenAI's default for completions
    echo: bool | None = False
    suffix: str | None = None
    best_of: Int32 | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # legacy: the alternatives per token

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise BadRequest("echo is not supported", param="echo")
        if self.best_of not in (None, self.n or self.n_cmpl or 1):
            raise BadRequest(f"best_of must equal n ({self.n or self.n_cmpl or 1}): duo returns every choice it "
                             f"generates, it does not rank them; got {self.best_of}", param="best_of")

    def logprob_count(self) -> int:
        return self.logprobs if self.logprobs is not None else super().logprob_count()

    def to_request(self) -> CompletionRequest:
        self.check_supported()
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise BadRequest(f"send one prompt per request, got {len(prompt)}", param="prompt")
            prompt = prompt[0]
        if self.suffix:  # the text after the hole: the model's fill-in-the-middle prompt (duo.api.infill)
            if not isinstance(prompt, str):
                raise BadRequest("suffix needs the prompt as text (the code before the hole)", param="suffix")
            return self.completion_request(max_tokens=self.token_limit("max_tokens"), fim=FimInput(prompt, self.suffix))
        if isinstance(prompt, list):
            return self.completion_request(max_tokens=self.token_limit("max_tokens"), prompt_tokens=prompt)
        return self.completion_request(max_tokens=self.token_limit("max_tokens"), prompt=prompt)


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON


class ToolCallBody(BaseModel):
    """A call in an earlier assistant message, sent back with the tool's result."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessageBody(Fenced):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # a participant's name: chat templates do not render it, nor does llama-server
    tool_calls: list[ToolCallBody] | None = None  # an assistant's calls
    tool_call_id: str | None = None               # a tool's result: the call it answers

    def text(self, index: int) -> str:
        """The message's text; only text parts can be rendered by a chat template."""
        if not isinstance(self.content, list):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise BadRequest(f"messages[{index}].content: only text parts are supported, got a {part.type!r} "
                                 "part", param=f"messages[{index}].content")
        return "".join(part.text or "" for part in self.content)


class ChatBody(GenerationBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageBody]
    max_completion_tokens: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolBody] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")

    def to_request(self) -> CompletionRequest:
        self.check_supported()
        if not self.messages:
            raise BadRequest("messages must not be empty: send at least one message", param="messages")
        try:
            use = tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ToolError as error:
            raise BadRequest(str(error), param=error.param) from error
        messages = template_messages(self.messages)
        return self.completion_request(max_tokens=self.token_limit("max_completion_tokens", "max_tokens"),
                                       messages=messages, tool_use=use)

    def logprob_count(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else super().logprob_count()

    def callable_functions(self) -> list[FunctionBody]:
        """The functions whose calls the answer parses out of the model's text (none: all of it is content)."""
        try:
            use = tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ToolError:
            return []  # to_request says what is wrong
        return use.callable if use else []


def template_messages(messages: list[ChatMessageBody]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (duo.api.tools.template_message); BadRequest for a field of a
    message that duo does not honour."""
    for i, message in enumerate(messages):
        message.check_fields(f"messages[{i}].")
    try:
        return [template_message("system" if m.role == "developer" else m.role, m.text(i),
                                 [call.model_dump() for call in m.tool_calls] if m.tool_calls else None,
                                 m.tool_call_id) for i, m in enumerate(messages)]
    except ToolError as error:
        raise BadRequest(str(error), param=error.param) from error
