"""Client requests whatever their transport: check them, queue them for a turn, and turn committed tokens into text."""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

from duo.api.admission import Admission, Slot
from duo.api.chat import chat_tokens
from duo.api.infill import FimInput, FimStops, NoFim, fim_tokens, stops_for
from duo.api.logprobs import described
from duo.api.metrics import Metrics
from duo.api.stop import StopMatcher
from duo.api.tools import CallFormat, ToolError, ToolUse, call_format, call_grammar
from duo.constraint import Cursor, GrammarError, GrammarSpec, grammar_of
from duo.infill_sampler import infill_vocab
from duo.model import Model, ModelError
from duo.penalties import Penalties
from duo.sampling import SamplingParams
from duo.target.generation import Target
from duo.target.request import GenerationStats, Request

log = logging.getLogger("duo.target")

# More stop strings than anyone needs would make every piece slow to check.
MAX_STOP_STRINGS = 16


class ClientError(Exception):
    """A request that cannot be served now; the message says why and what to do."""


class BadRequest(ClientError):
    """The request itself is wrong; `param` names the field to fix where there is one."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class UnknownModel(BadRequest):
    """The request names a model this server does not serve."""


class NotReady(ClientError):
    """The model is still loading."""


class ShuttingDown(NotReady):
    """duo-target is stopping: no new request, and a running one that outlives the grace period ends."""


@dataclass(frozen=True)
class CompletionRequest:
    """A request as a client sent it; exactly one of prompt, messages, prompt_tokens is used."""

    prompt: str = ""
    messages: Sequence[Mapping[str, Any]] = ()  # rendered with the model's chat template
    prompt_tokens: Sequence[int] | None = None  # a prompt already tokenized (an empty one is refused)
    max_tokens: int = 0                        # 0: until end of generation or a full context
    params: SamplingParams = SamplingParams()
    seed: int | None = None
    stop: Sequence[str] = ()
    cache_prompt: bool = True                  # false: no prompt prefix shared with other requests
    grammar: GrammarSpec | None = None         # the output must match it (duo.constraint)
    tool_use: ToolUse | None = None            # chat: the tools the template renders, and whether a call is due
    penalties: Penalties = Penalties()         # presence, frequency and repeat penalties, logit_bias
    logprobs: int = -1                         # >= 0: each token's logprob and this many alternatives'
    fim: FimInput | None = None                # fill-in-the-middle: the prompt is built around the hole
    infill_sampler: bool = False               # llama.cpp's infill sampler after the truncations
    n_indent: int = 0                          # llama-server's code-completion stop rules (duo.api.infill)
    t_max_predict_ms: int = 0
    arrived: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Piece:
    """New text (valid UTF-8, stop strings cut off) and the tokens committed since the last piece."""

    text: str
    token_ids: list[int]
    finish_reason: str | None  # set on the last piece: "stop" or "length"
    stats: GenerationStats
    draft_connected: bool
    stop_type: str = ""  # on the last piece, as llama-server says it: "eos", "word" (a stop string) or "limit"
    logprobs: list[dict[str, Any]] | None = None  # where asked, per token (duo.api.logprobs.described)


class Completion:
    """One admitted request: iterate it for its pieces; aclose() (always called, also early) frees its
    running place, and its sessions on the target and the draft."""

    def __init__(self, pieces: AsyncGenerator[Piece, None], slot: Slot) -> None:
        self._pieces = pieces
        self._slot = slot

    def __aiter__(self) -> AsyncIterator[Piece]:
        return self._pieces

    async def aclose(self) -> None:
        try:
            await self._pieces.aclose()
        finally:
            self._slot.release()


# The most an HTTP body or a client's gRPC message may hold (a prompt filling a 128k-token context is well
# under 1 MB of text); what a body may hold beside the prompt (stop strings, sampling, the messages' JSON).
MAX_BODY_BYTES = 16 * 1024 * 1024
BODY_FIELDS_BYTES = 1024 * 1024
SHUTTING_DOWN = "duo-target is shutting down; retry on another server, or once it is back"
DRAIN_POLL_S = 0.05
CUT_WAIT_S = 2.0  # after the grace period, what the ended requests get to send their errors
T = TypeVar("T")
# Tokenize calls at once, and waiting, beside the generations' own --parallel and --queue-size.
TOKENIZE_PARALLEL = 2
TOKENIZE_QUEUE = 64


class Completions:
    """The target as clients see it, shared by the gRPC and HTTP endpoints."""

    def __init__(self, admission: Admission, metrics: Metrics, names: Sequence[str]) -> None:
        self.admission = admission
        # Tokenize calls wait for a place of their own: beside generations, not behind them (they are
        # quick, and bounded like a prompt), but bounded too, so that they cannot flood the threads.
        self.tokenizing_admission = Admission(TOKENIZE_PARALLEL, TOKENIZE_QUEUE)
        self.starting_choices = asyncio.Lock()  # requests of several choices take their places one at a time
        self.metrics = metrics
        self.names = list(names)  # the first is the model's name; the others are accepted as aliases
        self.target: Target | None = None  # set once the model is loaded
        self.context_size = 0
        self._max_prompt_bytes = 0
        self.closing = False  # shutting down: new requests are refused
        self._cut = asyncio.Event()  # the grace period is over: running requests end

    def ready(self, target: Target, context_size: int) -> None:
        self.target = target
        self.context_size = context_size
        # No token is longer than the longest vocabulary text, so a prompt of more bytes than this
        # has more tokens than the context holds: refused without spending seconds tokenizing it.
        self._max_prompt_bytes = context_size * max(len(text) for text in target.model.vocab().token_texts)

    def max_items(self) -> int:
        """The most token ids or messages a prompt can hold and fit the context (each is one token at least);
        while the model loads, no more than a body's bytes."""
        return self.context_size if self.target is not None else MAX_BODY_BYTES

    def max_body_bytes(self) -> int:
        """The largest HTTP body worth reading: MAX_BODY_BYTES while the model loads; then what a prompt that fits
        the context can take as JSON (its text escaped 6 bytes a byte at worst) and the other fields' allowance."""
        if self.target is None:
            return MAX_BODY_BYTES
        return min(MAX_BODY_BYTES, 6 * self._max_prompt_bytes + BODY_FIELDS_BYTES)

    @property
    def draft_state(self) -> str:
        """The draft link's state: connected, disconnected or incompatible; "none" without --peer or while loading."""
        link = self.target.link if self.target else None
        return link.state if link else "none"

    @property
    def draft_connected(self) -> bool:
        return self.draft_state == "connected"

    def check_model(self, name: str | None) -> None:
        if name and name not in self.names:
            served = ", ".join(map(repr, self.names))
            raise UnknownModel(f"model {name!r} is not served here; this server serves {served}", param="model",
                               code="model_not_found")

    def tokenize(self, prompt: str = "", messages: Sequence[Mapping[str, Any]] = (),
                 tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        """The prompt's token ids: raw text (special tokens parsed) or chat messages (and tools) rendered with the
        model's chat template. Long prompts take a while: call this off the event loop."""
        model = self._loaded().model
        if prompt and messages:
            raise BadRequest("send either prompt or messages, not both")
        if messages:
            try:
                prompt = model.chat_prompt(messages, tools)
            except ModelError as error:
                raise BadRequest(str(error), param="messages") from error
        try:
            size = len(prompt.encode())
        except UnicodeEncodeError as error:  # JSON can carry lone surrogates, which UTF-8 cannot
            raise BadRequest(f"the prompt is not valid Unicode text ({error.reason} at character {error.start})",
                             param="messages" if messages else "prompt") from error
        if size > self._max_prompt_bytes:
            raise too_long(f"the prompt is far longer than the context of {self.context_size} tokens")
        return chat_tokens(model, messages, prompt, tools) if messages else model.tokenize(prompt)

    def prepare(self, request: CompletionRequest) -> Request:
        """The target's Request, or BadRequest saying what to fix."""
        model = self._loaded().model  # NotReady while the model loads
        params = replace(request.params, infill=infill_vocab(model)) if request.infill_sampler else request.params
        try:
            params.validate()
            request.penalties.validate(model.n_vocab)
        except ValueError as error:
            raise BadRequest(str(error)) from error
        if request.max_tokens < 0:
            raise BadRequest(f"max_tokens must be >= 0, got {request.max_tokens}", param="max_tokens")
        if request.seed is not None and not 0 <= request.seed < 2 ** 64:
            raise BadRequest(f"seed must be between 0 and 2^64 - 1, got {request.seed}", param="seed")
        check_stops(request.stop)
        spec = self._tool_grammar(request) if request.tool_use else request.grammar
        tokens = (self._fim_tokens(request) if request.fim else list(request.prompt_tokens)
                  if request.prompt_tokens is not None else self.tokenize(
                      request.prompt, request.messages, request.tool_use.offered if request.tool_use else ()))
        self._check_prompt(tokens)
        grammar, cursor = self._compiled(spec) if spec else ("", None)
        return Request(prompt_tokens=tokens, params=params, seed=request.seed, max_tokens=request.max_tokens,
                       cache_prompt=request.cache_prompt, grammar=grammar, constraint=cursor,
                       penalties=request.penalties, logprobs=request.logprobs,
                       arrived=request.arrived)

    def _fim_tokens(self, request: CompletionRequest) -> list[int]:
        try:
            return fim_tokens(self._loaded().model, request.fim, self.context_size, request.max_tokens)
        except NoFim as error:
            raise BadRequest(str(error), param="input_prefix", code="infill_not_supported") from error
        except UnicodeEncodeError as error:  # JSON can carry lone surrogates, which UTF-8 cannot
            raise BadRequest(f"the text around the hole is not valid Unicode ({error.reason})",
                             param="input_prefix") from error

    def _tool_grammar(self, request: CompletionRequest) -> GrammarSpec | None:
        """The request's grammar where it has tools: the call's, when one is due (tool_choice required or a named
        function); BadRequest for a template that cannot take them, or tool text that would render as control
        tokens (the template's markup is tokenized with special tokens parsed: a role of the client's making)."""
        model, use = self._loaded().model, request.tool_use
        try:
            format_ = call_format(model.chat_template())
        except ToolError as error:
            raise BadRequest(str(error), param=error.param) from error
        calls = [message.get("tool_calls") for message in request.messages]
        for text, param in [(json.dumps(use.offered), "tools"), (json.dumps(calls), "messages")]:
            if model.tokenize(text, add_special=False) != model.tokenize(text, add_special=False, parse_special=False):
                raise BadRequest(f"{param} hold the text of a control token of the model", param=param)
        if not use.required:
            return request.grammar
        if request.grammar:
            raise BadRequest("a required tool call and a response format cannot both hold: send one",
                             param="tool_choice")
        return GrammarSpec("lark", call_grammar(use.callable, use.parallel, format_, self._token_of), "tools")

    def _token_of(self, text: str) -> int | None:
        """The id of the model's one token for `text`, if it has one (a call format's markers)."""
        tokens = self._loaded().model.tokenize(text, add_special=False)
        return tokens[0] if len(tokens) == 1 else None

    def call_format(self) -> CallFormat | None:
        """How the model writes tool calls; None while it loads or where its template takes no tools."""
        try:
            return call_format(self.target.model.chat_template()) if self.target else None
        except ToolError:
            return None

    def _compiled(self, spec: GrammarSpec) -> tuple[str, Cursor]:
        """The grammar in llguidance's form and the target's cursor on it, or BadRequest saying what is wrong with
        it. Compiling is bounded (duo.constraint.LIMITS) and runs on prepare's thread, not the event loop."""
        try:
            grammar = grammar_of(spec.kind, spec.source)
            return grammar, Cursor.compile(self._loaded().model, grammar)
        except GrammarError as error:
            raise BadRequest(f"{spec.param}: {error}", param=spec.param, code="invalid_grammar") from error

    async def start(self, request: CompletionRequest) -> Completion:
        """Wait for the request's turn (QueueFull when the waiting line is full), then check it. Admission
        comes first: tokenizing and rendering a template cost work that --parallel and --queue-size
        bound like the generation itself."""
        self._open_for_requests()
        self.check_size(request)  # what cannot fit the context waits for no place
        slot = await self.admission.acquire()
        if self._cut.is_set():
            slot.release()
            raise ShuttingDown(SHUTTING_DOWN)
        preparing = asyncio.ensure_future(asyncio.to_thread(self.prepare, request))  # tokenizing takes a while
        try:
            prepared = await asyncio.shield(preparing)
            target = self._loaded()
        except asyncio.CancelledError:
            # The client left: the thread tokenizes on, and its place stays taken until it stops.
            preparing.add_done_callback(partial(_release_after, slot))
            raise
        except BaseException:
            slot.release()
            raise
        stops = stops_for(request.stop, request.n_indent, request.t_max_predict_ms, request.fim)
        return Completion(self._pieces(target, prepared, stops), slot)

    def check_size(self, request: CompletionRequest) -> None:
        """BadRequest for a prompt that cannot fit the context, found in one pass over what the client sent:
        more token ids than the context holds, more text than its tokens could spell, more messages than
        tokens (each message renders to one token at least)."""
        if self.target is None:
            return  # prepare says NotReady
        if request.prompt_tokens is not None and len(request.prompt_tokens) >= self.context_size:
            raise too_long(f"the prompt has {len(request.prompt_tokens)} tokens; the context holds "
                                 f"{self.context_size}")
        if len(request.messages) >= self.context_size:
            raise too_long(f"{len(request.messages)} messages cannot fit a context of {self.context_size} tokens",
                           param="messages")
        texts = [request.prompt] + [str(message.get("content", "")) for message in request.messages]
        if sum(len(text) for text in texts) > self._max_prompt_bytes:  # characters: at least one byte each
            raise too_long(f"the prompt is far longer than the context of {self.context_size} tokens")

    async def tokenizing(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """work(*args, **kwargs) on a thread (tokenizing, rendering a template), admitted among such calls
        (QueueFull when their line is full); NotReady while the model loads."""
        self._open_for_requests()
        self._loaded()
        slot = await self.tokenizing_admission.acquire()
        try:
            return await asyncio.to_thread(work, *args, **kwargs)
        finally:
            slot.release()

    async def _pieces(self, target: Target, request: Request,
                      stops: StopMatcher | FimStops) -> AsyncGenerator[Piece, None]:
        # Characters may span tokens: the decoder holds back bytes until they complete a character.
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stats = GenerationStats(prompt_tokens=len(request.prompt_tokens), arrived=request.arrived)
        finish: str | None = None
        why_not = "client left"  # why a request ended without a finish reason
        try:
            async with aclosing(target.generate(request)) as steps, aclosing(self._until_cut(steps)) as cuttable:
                async for step, stats in cuttable:
                    ended = step.finish_reason is not None
                    text, stopped = stops.feed(decoder.decode(target.model.detokenize(step.tokens), final=ended))
                    finish = "stop" if stopped else step.finish_reason
                    if finish and not stopped:
                        text += stops.flush()
                    why = stops.why if stopped else {"stop": "eos", "length": "limit"}.get(finish or "", "")
                    logprobs = None if step.logprobs is None else described(target.model, step.tokens, step.logprobs)
                    yield Piece(text, step.tokens, finish, stats, self.draft_connected, why, logprobs)
                    if finish:
                        # Leaving `aclosing` closes target.generate now, which frees the sessions at once.
                        return
        except ShuttingDown:
            why_not = "ended by the shutdown"
            raise
        finally:
            self.metrics.request_finished(stats, finish)
            log.info("%s", stats.log_line(finish or why_not))

    async def drain(self, grace: float) -> None:
        """Stop taking requests; let the running and waiting ones finish within `grace` seconds, then end
        the rest with ShuttingDown (their clients get an error of their API's shape, not a cut connection)."""
        self.closing = True
        deadline = time.monotonic() + grace
        while (self.admission.running or self.admission.waiting) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        self._cut.set()
        deadline = time.monotonic() + CUT_WAIT_S
        while self.admission.running and time.monotonic() < deadline:  # their error responses go out
            await asyncio.sleep(DRAIN_POLL_S)

    async def _until_cut(self, steps: AsyncIterator[T]) -> AsyncIterator[T]:
        """`steps`, ended by ShuttingDown where the grace period runs out first (even within a long step)."""
        cut = asyncio.ensure_future(self._cut.wait())
        step: asyncio.Future[T] | None = None
        try:
            while True:
                step = asyncio.ensure_future(anext(steps))
                await asyncio.wait({step, cut}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    raise ShuttingDown(SHUTTING_DOWN)
                if isinstance(step.exception(), StopAsyncIteration):
                    return
                yield step.result()
        finally:
            cut.cancel()
            if step is not None and not step.done():  # cut, or the client left: the step ends now
                step.cancel()
                await asyncio.wait({step})

    def _open_for_requests(self) -> None:
        if self.closing:
            raise ShuttingDown(SHUTTING_DOWN)

    def loaded_model(self) -> Model:
        """The target's model; NotReady while it loads."""
        return self._loaded().model

    def _loaded(self) -> Target:
        if self.target is None:
            raise NotReady("the model is still loading; retry in a moment")
        return self.target

    def _check_prompt(self, tokens: list[int]) -> None:
        if not tokens:
            raise BadRequest("the prompt is empty", param="prompt")
        n_vocab = self._loaded().model.n_vocab
        if not all(0 <= token < n_vocab for token in tokens):
            raise BadRequest(f"prompt token ids must be between 0 and {n_vocab - 1}", param="prompt")
        if len(tokens) >= self.context_size:
            raise too_long(f"the prompt has {len(tokens)} tokens; the context holds {self.context_size}, "
                                 "which must leave room for at least one new token")



def too_long(message: str, param: str = "prompt") -> BadRequest:
    """A prompt that cannot fit the context: what to do about it."""
    return BadRequest(f"{message}: shorten the prompt or start duo-target with a larger --ctx-size",
                      param=param, code="context_length_exceeded")


def _release_after(slot: Slot, work: asyncio.Future) -> None:
    """Free `slot` once the work of a request whose client left has stopped."""
    slot.release()
    if not work.cancelled():
        work.exception()  # retrieved: the error of a request nobody waits for is nobody's to report


def failure_message(error: Exception) -> str:
    """What a client is told when its own request failed while generating, logged here: a ModelError says
    what failed; anything else is a bug, logged with the traceback that will fix it. Only that request ends."""
    if isinstance(error, ModelError):
        log.error("generation failed: %s", error)
    else:
        log.error("generation failed on an unexpected error", exc_info=error)
    return f"generation failed: {error}"


def check_stops(stops: Sequence[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}", param="stop")
    if any(not stop for stop in stops):
        raise BadRequest("stop strings must not be empty", param="stop")
