"""Checking a client's request and preparing it for the target: its prompt tokenized (chat template, FIM layout),
its grammar compiled, every field checked against the model; off the event loop."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from duo.api.serving.chat_tokens import Turn, chat_tokens
from duo.api.output.deltas import Reasoning
from duo.api.serving.infill import NoFim, fim_tokens
from duo.api.serving.limits import INT32_MAX, INT32_MIN
from duo.api.serving.request import BadRequest, CompletionRequest, check_stops, rendered_chat, too_long
from duo.api.tools import (GENERIC, ToolError, call_format, call_grammar, lazy_call_grammar, thinking_opened,
                            with_tools_described)
from duo.constraint import GrammarError, GrammarSpec, grammar_of
from duo.llama.model import Model, ModelError
from duo.llama.templates import reserved_names
from duo.sampling.ops.infill import infill_vocab
from duo.sampling.ops.penalties import Penalties, summed_biases
from duo.target.request import Request

class Preparer:
    """Requests for one loaded model and context: Request objects for the target, or BadRequest saying what to fix.
    Its work takes a while (tokenizing, compiling): call it off the event loop."""

    def __init__(self, model: Model, context_size: int) -> None:
        self.model = model
        self.context_size = context_size
        # No token is longer than the longest vocabulary text, so a prompt of more bytes than this
        # has more tokens than the context holds: refused without spending seconds tokenizing it.
        self.max_prompt_bytes = context_size * max(len(text) for text in model.vocab().token_texts)

    def tokenize(self, prompt: str = "", messages: Sequence[Mapping[str, Any]] = (),
                 tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        """The prompt's token ids: raw text (special tokens parsed) or chat messages (and tools) rendered with the
        model's chat template. Long prompts take a while: call this off the event loop."""
        return self._rendered(prompt, messages, tools)[0]

    def _rendered(self, prompt: str = "", messages: Sequence[Mapping[str, Any]] = (),
                  tools: Sequence[Mapping[str, Any]] = (), variables: Mapping[str, Any] | None = None,
                  turn: Turn = Turn(), chat: bool = False) -> tuple[list[int], str]:
        """The prompt's token ids and its text (the chat rendered, for messages or where `chat` says so, ending with
        `turn`'s prefill: a request's `chat` is request.rendered_chat, which a prefill makes true)."""
        model = self.model
        if prompt and messages:
            raise BadRequest("send either prompt or messages, not both")
        chat = chat or bool(messages)
        if chat:
            reserved = reserved_names(variables or {})
            if reserved:
                raise BadRequest(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
            try:
                prompt = model.chat_prompt(messages, tools, variables, generation_prompt=turn.generation_prompt) + \
                    (turn.prefill or "")
            except ModelError as error:
                raise BadRequest(str(error), param="messages") from error
        try:
            size = len(prompt.encode())
        except UnicodeEncodeError as error:  # JSON can carry lone surrogates, which UTF-8 cannot
            raise BadRequest(f"the prompt is not valid Unicode text ({error.reason} at character {error.start})",
                             param="messages" if messages else "prompt") from error
        if size > self.max_prompt_bytes:
            raise self._far_too_long(size)
        if not chat:
            return model.tokenize(prompt), prompt
        return chat_tokens(model, messages, prompt, tools, variables, turn), prompt

    def prepare(self, request: CompletionRequest) -> tuple[Request, str, Reasoning]:
        """The target's Request, its grammar in llguidance's form but not compiled yet (the caller compiles it within
        a budget: duo.constraint.Compiler), the field that held the grammar and how the answer's reasoning reads; or
        BadRequest saying what to fix."""
        model = self.model
        params = replace(request.params, infill=infill_vocab(model)) if request.infill_sampler else request.params
        penalties = self._penalties(request)
        try:
            params.validate()
            penalties.validate(model.n_vocab)
        except ValueError as error:  # their messages start with the field they name ("top_p must be ...")
            field = str(error).split(" ", 1)[0]
            raise BadRequest(str(error), param=field if field.isidentifier() else None) from error
        penalties = penalties.for_vocab(model)  # DRY's breakers in the model's tokens
        if request.max_tokens < 0:
            raise BadRequest(f"max_tokens must be >= 0, got {request.max_tokens}", param="max_tokens")
        if request.seed is not None and not 0 <= request.seed < 2 ** 64:
            raise BadRequest(f"seed must be between 0 and 2^64 - 1, got {request.seed}", param="seed")
        for name in ("n_indent", "t_max_predict_ms"):  # the HTTP bodies bound them; gRPC and callers may not
            if not INT32_MIN <= getattr(request, name) <= INT32_MAX:
                raise BadRequest(f"{name} must be between {INT32_MIN} and {INT32_MAX}", param=name)
        check_stops(request.stop)
        self._check_no_markup(request)
        spec = self._tool_grammar(request) if request.tool_use else request.grammar
        tokens, prompt = (self._fim_tokens(request), "") if request.fim else (self._mixed(request.prompt_tokens), "") \
            if request.prompt_tokens is not None else self._chat_rendered(request)
        self._check_prompt(tokens)
        opened = rendered_chat(request) and thinking_opened(prompt, self._format(request))
        return Request(prompt_tokens=tokens, params=params, seed=request.seed, max_tokens=request.max_tokens,
                       cache_prompt=request.cache_prompt, grammar=self._grammar(spec) if spec else "",
                       penalties=penalties, logprobs=request.logprobs, post_sampling=request.post_sampling_probs,
                       arrived=request.arrived), spec.param if spec else "", Reasoning(request.reasoning_format, opened)

    def _chat_rendered(self, request: CompletionRequest) -> tuple[list[int], str]:
        """The request's prompt tokens and text; with tools on a template with no tool syntax (the generic format),
        the tools are described in the system message instead."""
        use, messages, tools = request.tool_use, request.messages, ()
        if use is not None:
            tools = use.offered
            if self._format(request) is GENERIC:
                messages, tools = with_tools_described([dict(m) for m in messages], tools), ()
        return self._rendered(request.prompt, messages, tools, request.chat_template_kwargs,
                              Turn(request.prefill, request.generation_prompt), rendered_chat(request))

    def _format(self, request: CompletionRequest) -> Any:
        """The template's call format where the request has tools (None without)."""
        if request.tool_use is None:
            return None
        try:
            return call_format(self.model.chat_template())
        except ToolError as error:
            raise BadRequest(str(error), param=error.param) from error

    def _penalties(self, request: CompletionRequest) -> Penalties:
        """The request's logit transforms, its biases as llama-server applies them: each text's tokens biased
        (tokenized as llama-server tokenizes them: no BOS, a control token's text as text), and with ignore_eos every
        end-of-generation token banned (a bias of -inf), so the answer runs to its token limit or the context's end;
        every entry of a token adds up (summed_biases)."""
        texts = [(token, bias) for text, bias in request.bias_texts for token in self._bias_tokens(text)]
        banned = [(token, -math.inf) for token in self.model.end_of_generation_ids()] if request.ignore_eos else []
        if not (texts or banned):
            return request.penalties
        return replace(request.penalties, bias=summed_biases([*request.penalties.bias, *texts, *banned]))

    def _bias_tokens(self, text: str) -> list[int]:
        return self._tokens(text, f"logit_bias: {text!r:.40}", "logit_bias", add_special=False, parse_special=False)

    def _tokens(self, text: str, what: str, param: str, **options: bool) -> list[int]:
        """`text`'s token ids (model.tokenize's `options`), or a 400 naming `param` where it is no valid Unicode."""
        try:
            return self.model.tokenize(text, **options)
        except UnicodeEncodeError as error:  # JSON can carry lone surrogates, which UTF-8 cannot
            raise BadRequest(f"{what} is not valid Unicode text ({error.reason})", param=param) from error

    def _fim_tokens(self, request: CompletionRequest) -> list[int]:
        try:
            return fim_tokens(self.model, request.fim, self.context_size, request.max_tokens)
        except NoFim as error:
            raise BadRequest(str(error), param="input_prefix", code="infill_not_supported") from error
        except UnicodeEncodeError as error:  # JSON can carry lone surrogates, which UTF-8 cannot
            raise BadRequest(f"the text around the hole is not valid Unicode ({error.reason})",
                             param="input_prefix") from error

    def _mixed(self, parts: Sequence[int | str]) -> list[int]:
        """llama-server's prompt of ids and texts mixed (tokenize_mixed): each text tokenized where it stands, special
        tokens parsed, with the model's BOS only where a text comes first."""
        tokens: list[int] = []
        for i, part in enumerate(parts):
            is_text = isinstance(part, str)
            tokens += self._tokens(part, f"prompt[{i}]", "prompt", add_special=i == 0) if is_text else [part]
        return tokens

    def _check_no_markup(self, request: CompletionRequest) -> None:
        """BadRequest where a string of the client's that the chat template writes raw (a tool's definition, an
        earlier call's name, arguments or id, a tool result's call id) holds the text of a control token: the
        template's markup is tokenized with special tokens parsed, so it would open a role of the client's making.
        Message contents are never markup (duo.api.serving.chat_tokens); everything else is checked, with tools or without."""
        model = self.model
        raw = [{key: message[key] for key in ("tool_calls", "tool_call_id") if message.get(key) is not None}
               for message in request.messages]
        offered = request.tool_use.offered if request.tool_use else []
        for strings, param in [(offered, "tools"), ([message for message in raw if message], "messages")]:
            text = json.dumps(strings, ensure_ascii=False)  # as the template writes them: not escaped
            if len(text) > self.max_prompt_bytes:  # tokenizing it would cost seconds (4 MB: 20 s), for a 400
                raise self._far_too_long(len(text), param)
            if strings and model.tokenize(text, add_special=False) != model.tokenize(text, add_special=False,
                                                                                      parse_special=False):
                raise BadRequest(f"{param} hold the text of a control token of the model", param=param)

    def _tool_grammar(self, request: CompletionRequest) -> GrammarSpec | None:
        """The request's grammar where it has tools: the call's, when one is due (tool_choice required or a named
        function); under `auto`, free text until the model opens a call and the call's from there on, as llama-server
        samples it (lazy_call_grammar); BadRequest for a template that cannot take them."""
        use, format_ = request.tool_use, self._format(request)
        if not use.required and format_ is not GENERIC:
            if request.grammar or not use.callable:
                return request.grammar
            try:
                lazy = lazy_call_grammar(use.callable, use.parallel, format_, self._token_of)
            except ToolError:  # a custom tool's grammar this format cannot enforce: its calls are parsed, as before
                return None
            return GrammarSpec("lark", lazy, "tools") if lazy else None
        if request.grammar:  # the generic format's every answer is written by its grammar
            raise BadRequest("a required tool call (or tools on a template with no tool syntax) and a response format "
                             "cannot both hold: send one", param="tool_choice")
        try:
            grammar = call_grammar(use.callable, use.parallel, format_, self._token_of, use.required)
        except ToolError as error:  # a custom tool's Lark grammar, in a format that writes its input raw
            raise BadRequest(str(error), param=error.param) from error
        return GrammarSpec("lark", grammar, "tools")

    def _token_of(self, text: str) -> int | None:
        """The id of the model's one token for `text`, if it has one (a call format's markers)."""
        tokens = self.model.tokenize(text, add_special=False)
        return tokens[0] if len(tokens) == 1 else None

    @staticmethod
    def _grammar(spec: GrammarSpec) -> str:
        """The grammar in llguidance's form, or BadRequest where it is not even of its kind (a schema that is not
        JSON); whether it compiles, and at what cost, the compile says."""
        try:
            return grammar_of(spec.kind, spec.source)
        except GrammarError as error:
            raise BadRequest(f"{spec.param}: {error}", param=spec.param, code="invalid_grammar") from error

    def check_size(self, request: CompletionRequest) -> None:
        """BadRequest for a prompt that cannot fit the context, found in one pass over what the client sent:
        more token ids than the context holds, more text than its tokens could spell, more messages than
        tokens (each message renders to one token at least)."""
        if request.prompt_tokens is not None and len(request.prompt_tokens) >= self.context_size:
            raise too_long("the prompt must leave room for one new token", n_prompt_tokens=len(request.prompt_tokens),
                           n_ctx=self.context_size)
        if len(request.messages) >= self.context_size:
            raise too_long(f"{len(request.messages)} messages take a token each at least",
                           n_prompt_tokens=len(request.messages), n_ctx=self.context_size, param="messages")
        texts = [request.prompt, request.prefill or ""] + [str(message.get("content", ""))
                                                          for message in request.messages] + \
            [part for part in request.prompt_tokens or () if isinstance(part, str)]
        size = sum(len(text) for text in texts)  # characters: at least one byte each
        if size > self.max_prompt_bytes:
            raise self._far_too_long(size)

    def check_text_size(self, text: str, param: str) -> None:
        """BadRequest for a text to tokenize that has more characters than the context's tokens could spell."""
        if len(text) > self.max_prompt_bytes:
            raise self._far_too_long(len(text), param)

    def _far_too_long(self, size: int, param: str = "prompt") -> BadRequest:
        """A prompt of `size` bytes, refused untokenized: no token spells more than the longest vocabulary text, so
        it has size / that many tokens at least (more than the context holds)."""
        longest = self.max_prompt_bytes // self.context_size
        return too_long(f"{param} is far longer than the context", n_prompt_tokens=-(-size // longest),
                        n_ctx=self.context_size, param=param)

    def _check_prompt(self, tokens: list[int]) -> None:
        if not tokens:
            raise BadRequest("the prompt is empty", param="prompt")
        n_vocab = self.model.n_vocab
        if not all(0 <= token < n_vocab for token in tokens):
            raise BadRequest(f"prompt token ids must be between 0 and {n_vocab - 1}", param="prompt")
        if len(tokens) >= self.context_size:
            raise too_long("the prompt must leave room for one new token", n_prompt_tokens=len(tokens),
                           n_ctx=self.context_size)
