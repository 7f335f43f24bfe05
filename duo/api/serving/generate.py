"""Client requests whatever their transport: check them, queue them for a turn, and turn committed tokens into text."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from duo.api.serving.admit import Admission, QueueFull, Slot
from duo.api.serving.chat_tokens import marker_tokens
from duo.api.output.deltas import Reasoning
from duo.api.serving.infill import FimStops, stops_for
from duo.api.serving.limits import BodyLimits
from duo.api.output.logprobs import described
from duo.api.serving.metrics import Metrics
from duo.api.serving.prepare import Preparer
from duo.api.serving.request import BadRequest, CompletionRequest, NotReady, ShuttingDown
from duo.api.serving.decode import SourcedDecoder, step_sources
from duo.api.serving.stop import StopMatcher
from duo.api.tools import CallFormat, ToolError, call_format
from duo.constraint import Compiler, CompilerBusy, Cursor, GrammarError, GrammarTooCostly
from duo.llama.model import Model, ModelError
from duo.sampling.distributions import NoTokenAllowed
from duo.target.progress import ReadProgress
from duo.target.target import Target
from duo.target.request import GenerationStats, Request

log = logging.getLogger("duo.target")


@dataclass(frozen=True)
class Piece:
    """New text (valid UTF-8, stop strings cut off) and the tokens committed since the last piece."""

    text: str
    token_ids: list[int]
    finish_reason: str | None  # set on the last piece: "stop" or "length"
    stats: GenerationStats
    draft_connected: bool
    stop_type: str = ""  # on the last piece, as llama-server says it: "eos", "word" (a stop string) or "limit"
    logprobs: list[dict[str, Any]] | None = None  # where asked, per token (duo.api.output.logprobs.described)
    reasoning: Reasoning = Reasoning()  # how the answer's reasoning reads (chat: the prompt may have opened it)
    stop_word: str = ""  # on the last piece, the stop string that ended the answer, where one did
    sources: tuple[str, ...] = ()  # the source of each character of `text` (duo.api.serving.decode)
    token_sources: tuple[str, ...] = ()  # the source of each of `token_ids` (duo.target.request.SOURCES)
    prompt_tokens: Sequence[int] = ()  # the prompt as the target read it (llama-server's answers show it)
    logit_bias: tuple[tuple[int, float], ...] = ()  # the biases as the target applies them (generation_settings)
    # Where the request asked (CompletionRequest.progress): a piece of no text that tells how far the prompt's read
    # got, before the first token's.
    progress: ReadProgress | None = None


class Completion:
    """One admitted request: iterate it for its pieces; aclose() (always called, also early) frees its
    running place, and its sessions on the target and the draft."""

    def __init__(self, pieces: AsyncGenerator[Piece, None], slot: Slot, prompt_tokens: int = 0) -> None:
        self._pieces = pieces
        self._slot = slot
        self.prompt_tokens = prompt_tokens  # the prepared prompt's tokens, known before it is read

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
        self.compiler = Compiler()  # grammars, each within its budget and on a thread of its own
        self.metrics = metrics
        self.names = list(names)  # what /v1/models lists: the model's name first, then its aliases (any name is served)
        self.target: Target | None = None  # set once the model is loaded
        self.context_size = 0
        self._preparer: Preparer | None = None  # set once the model is loaded
        self._markers: frozenset[int] | None = None  # the template's markup tokens an answer spells out
        self.closing = False  # shutting down: new requests are refused
        self._cut = asyncio.Event()  # the grace period is over: running requests end

    def ready(self, target: Target, context_size: int) -> None:
        self.target = target
        self.context_size = context_size
        self._preparer = Preparer(target.model, context_size)

    def body_limits(self) -> BodyLimits:
        """What a body's lists may hold (duo.api.serving.limits.BodyLimits); while the model loads, no more than a body's
        bytes."""
        if self.target is None:
            return BodyLimits(MAX_BODY_BYTES, MAX_BODY_BYTES)
        return BodyLimits(self.context_size, self.target.model.n_vocab)

    def max_body_bytes(self) -> int:
        """The largest HTTP body worth reading: MAX_BODY_BYTES while the model loads; then what a prompt that fits
        the context can take as JSON (its text escaped 6 bytes a byte at worst) and the other fields' allowance."""
        if self.target is None:
            return MAX_BODY_BYTES
        return min(MAX_BODY_BYTES, 6 * self.preparer().max_prompt_bytes + BODY_FIELDS_BYTES)

    @property
    def draft_state(self) -> str:
        """The draft link's state: connected, disconnected or incompatible; "none" without --peer or while loading."""
        pool = self.target.pool if self.target else None
        return pool.state if pool else "none"

    def drafts(self) -> list[dict[str, Any]]:
        """Each draft of the pool as /props and /health show it (duo.target.pool.pool.Member.describe)."""
        pool = self.target.pool if self.target else None
        return pool.describe() if pool else []

    @property
    def draft_connected(self) -> bool:
        return self.draft_state == "connected"

    def preparer(self) -> Preparer:
        """What checks and prepares requests (duo.api.serving.prepare); NotReady while the model loads."""
        if self._preparer is None:
            raise NotReady("the model is still loading; retry in a moment")
        return self._preparer

    def prepare(self, request: CompletionRequest) -> tuple[Request, str, Reasoning]:
        """The target's Request for `request`, its grammar's field and how its answer's reasoning reads, or BadRequest
        (Preparer.prepare; off the event loop)."""
        return self.preparer().prepare(request)

    def tokenize(self, prompt: str = "", messages: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        """The prompt's token ids, or BadRequest (off the event loop)."""
        return self.preparer().tokenize(prompt, messages)

    async def _compiled(self, target: Target, grammar: str, param: str) -> Cursor:
        """The target's cursor on `grammar`, compiled within its budget (duo.constraint.Compiler); BadRequest naming
        `param` where it cannot be, QueueFull while too many grammars compile."""
        try:
            return await self.compiler.compile(target.model, grammar)
        except GrammarError as error:
            code = "grammar_too_complex" if isinstance(error, GrammarTooCostly) else "invalid_grammar"
            raise BadRequest(f"{param}: {error}", param=param, code=code) from error
        except CompilerBusy as error:
            raise QueueFull(str(error)) from error

    def check_size(self, request: CompletionRequest) -> None:
        """BadRequest for a prompt that cannot fit the context (Preparer.check_size); nothing while the model loads:
        its start says NotReady."""
        if self._preparer is not None:
            self._preparer.check_size(request)

    def check_text_size(self, text: str, param: str) -> None:
        if self._preparer is not None:
            self._preparer.check_text_size(text, param)

    def call_format(self) -> CallFormat | None:
        """How the model writes tool calls; None while it loads or where it has no chat template."""
        try:
            return call_format(self.target.model.chat_template()) if self.target else None
        except ToolError:
            return None

    async def start_choices(self, requests: Sequence[CompletionRequest]) -> list[Completion]:
        """Wait for the turn of a request of len(requests) choices (QueueFull when the waiting line is full), then
        check and prepare it: choices that differ only by their seeds (duo.api.serving.choices.choice_requests) are
        prepared once, their prompt tokenized and their grammar compiled once, and each choice walks a copy of the
        grammar; each prompt of a batch (llama-server's /completion) is prepared on its own. Admission
        comes first: tokenizing and rendering a template cost work that --parallel and --queue-size bound like the
        generation itself. Whatever fails before the completions exist gives the places back (Places)."""
        self._open_for_requests()
        for request in requests:
            self.check_size(request)  # what cannot fit the context waits for no place
        with await self.admission.acquire_places(len(requests)) as places:
            if self._cut.is_set():
                raise ShuttingDown(SHUTTING_DOWN)
            # Choices differing by their seed alone are prepared once; each prompt of a batch (llama-server's) its own.
            firsts = {i: request for i, request in enumerate(requests)
                      if i == 0 or replace(request, seed=requests[i - 1].seed) != requests[i - 1]}
            preparing = asyncio.ensure_future(asyncio.to_thread(lambda: {i: self.prepare(request)
                                                                         for i, request in firsts.items()}))
            try:
                prepared_at = await asyncio.shield(preparing)  # tokenizing takes a while
            except asyncio.CancelledError:
                places.release_after(preparing)  # the client left: the thread works on, and holds the places
                raise
            target = self._loaded()
            completions = []
            for i, request in enumerate(requests):
                if i in prepared_at:
                    prepared, grammar_param, reasoning = prepared_at[i]
                    if prepared.grammar:
                        prepared = replace(prepared, constraint=await self._compiled(target, prepared.grammar,
                                                                                     grammar_param))
                    choice = prepared
                else:  # another choice of the same prompt: a copy of its grammar's cursor
                    choice = replace(prepared, seed=request.seed,
                                     constraint=prepared.constraint.copy() if prepared.constraint else None)
                stops = stops_for(request.stop, request.n_indent, request.t_max_predict_ms, request.fim)
                completions.append((choice, stops, reasoning))
            answer = _warm_up_answer if requests[0].warm_up else _as_generated
            preserved = self._marker_tokens(target.model) if requests[0].messages else frozenset()
            progress = requests[0].progress and not requests[0].warm_up
            return [Completion(answer(self._pieces(target, choice, stops, reasoning, preserved, progress)), slot,
                               len(choice.prompt_tokens))
                    for (choice, stops, reasoning), slot in zip(completions, places.hand_over())]

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

    def _marker_tokens(self, model: Model) -> frozenset[int]:
        """The control tokens of the chat template's call and reasoning markup (duo.api.serving.chat_tokens.marker_tokens)."""
        if self._markers is None:
            format_ = self.call_format()
            self._markers = marker_tokens(model, format_.markers) if format_ else frozenset()
        return self._markers

    async def _pieces(self, target: Target, request: Request, stops: StopMatcher | FimStops, reasoning: Reasoning,
                      preserved: frozenset[int], progress: bool) -> AsyncGenerator[Piece, None]:
        # Characters may span tokens: the decoder holds back bytes until they complete a character.
        decoder = SourcedDecoder(target.model, preserved)
        # Filled by the target as it runs: a request whose client left during the prompt read is logged and counted
        # with the prefix it found in the cache, as one that finished.
        stats = GenerationStats(prompt_tokens=len(request.prompt_tokens), arrived=request.arrived)
        finish: str | None = None
        why_not = "client left"  # why a request ended without a finish reason
        try:
            async with (aclosing(target.generate(request, stats, progress)) as steps,
                        aclosing(self._until_cut(steps)) as cuttable):
                async for step, stats in cuttable:
                    if isinstance(step, ReadProgress):
                        yield Piece("", [], None, stats, self.draft_connected, progress=step)
                        continue
                    ended = step.finish_reason is not None
                    text, stopped = stops.feed(decoder.decode(step, final=ended))
                    finish = "stop" if stopped else step.finish_reason
                    if finish and not stopped:
                        text += stops.flush()
                    why = stops.why if stopped else {"stop": "eos", "length": "limit"}.get(finish or "", "")
                    logprobs = None if step.logprobs is None else described(target.model, step.tokens, step.logprobs)
                    yield Piece(text, step.tokens, finish, stats, self.draft_connected, why, logprobs, reasoning,
                                stops.word if stopped else "", decoder.release(len(text)), step_sources(step),
                                request.prompt_tokens, logit_bias=request.penalties.bias)
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


def failure_message(error: Exception) -> str:
    """What a client is told when its own request failed while generating, logged here: a ModelError says
    what failed, and so does the request's own doing (request_fault); anything else is a bug, logged with the
    traceback that will fix it. Only that request ends."""
    if request_fault(error):
        log.warning("generation ended by the request itself: %s", error)
    elif isinstance(error, ModelError):
        log.error("generation failed: %s", error)
    else:
        log.error("generation failed on an unexpected error", exc_info=error)
    return f"generation failed: {error}"


def request_fault(error: Exception) -> bool:
    """Whether a generation failed of what the request asked for (its grammar costs more than its budget at some
    position, its logit_bias and grammar leave no token), which the client must change: a 400, not a 500."""
    return isinstance(error, (GrammarError, NoTokenAllowed))


def _as_generated(pieces: AsyncGenerator[Piece, None]) -> AsyncGenerator[Piece, None]:
    return pieces


async def _warm_up_answer(pieces: AsyncGenerator[Piece, None]) -> AsyncGenerator[Piece, None]:
    """A warm-up's one piece: its prompt read (its stats say how much of it was cached already) and the token
    decoded to read it dropped, so that nothing was generated, as llama-server answers n_predict 0."""
    async with aclosing(pieces):
        async for piece in pieces:
            if piece.finish_reason:
                yield replace(piece, text="", token_ids=[], finish_reason="length", stop_type="limit", logprobs=None,
                              stats=replace(piece.stats, generated_tokens=0), sources=(), token_sources=())
