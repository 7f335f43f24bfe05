"""Checking a client's request and preparing it for the target: its prompt tokenized (chat template, FIM layout),
its grammar compiled, every field checked against the model; off the event loop."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from duo.api.chat import chat_tokens
from duo.api.infill import NoFim, fim_tokens
from duo.api.limits import INT32_MAX, INT32_MIN
from duo.api.requests import BadRequest, CompletionRequest, check_stops, too_long
from duo.api.tools import ToolError, call_format, call_grammar
from duo.constraint import GrammarError, GrammarSpec, grammar_of
from duo.infill_sampler import infill_vocab
from duo.model import Model, ModelError
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
        model = self.model
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
        if size > self.max_prompt_bytes:
            raise too_long(f"the prompt is far longer than the context of {self.context_size} tokens")
        return chat_tokens(model, messages, prompt, tools) if messages else model.tokenize(prompt)

    def prepare(self, request: CompletionRequest) -> tuple[Request, str]:
        """The target's Request, its grammar in llguidance's form but not compiled yet (the caller compiles it within
        a budget: duo.constraint.Compiler), and the field that held the grammar; or BadRequest saying what to fix."""
        model = self.model
        params = replace(request.params, infill=infill_vocab(model)) if request.infill_sampler else request.params
        try:
            params.validate()
            request.penalties.validate(model.n_vocab)
        except ValueError as error:  # their messages start with the field they name ("top_p must be ...")
            field = str(error).split(" ", 1)[0]
            raise BadRequest(str(error), param=field if field.isidentifier() else None) from error
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
        tokens = (self._fim_tokens(request) if request.fim else list(request.prompt_tokens)
                  if request.prompt_tokens is not None else self.tokenize(
                      request.prompt, request.messages, request.tool_use.offered if request.tool_use else ()))
        self._check_prompt(tokens)
        return Request(prompt_tokens=tokens, params=params, seed=request.seed, max_tokens=request.max_tokens,
                       cache_prompt=request.cache_prompt, grammar=self._grammar(spec) if spec else "",
                       penalties=request.penalties, logprobs=request.logprobs,
                       arrived=request.arrived), spec.param if spec else ""

    def _fim_tokens(self, request: CompletionRequest) -> list[int]:
        try:
            return fim_tokens(self.model, request.fim, self.context_size, request.max_tokens)
        except NoFim as error:
            raise BadRequest(str(error), param="input_prefix", code="infill_not_supported") from error
        except UnicodeEncodeError as error:  # JSON can carry lone surrogates, which UTF-8 cannot
            raise BadRequest(f"the text around the hole is not valid Unicode ({error.reason})",
                             param="input_prefix") from error

    def _check_no_markup(self, request: CompletionRequest) -> None:
        """BadRequest where a string of the client's that the chat template writes raw (a tool's definition, an
        earlier call's name, arguments or id, a tool result's call id) holds the text of a control token: the
        template's markup is tokenized with special tokens parsed, so it would open a role of the client's making.
        Message contents are never markup (duo.api.chat); everything else is checked, with tools or without."""
        model = self.model
        raw = [{key: message[key] for key in ("tool_calls", "tool_call_id") if message.get(key) is not None}
               for message in request.messages]
        offered = request.tool_use.offered if request.tool_use else []
        for strings, param in [(offered, "tools"), ([message for message in raw if message], "messages")]:
            text = json.dumps(strings, ensure_ascii=False)  # as the template writes them: not escaped
            if strings and model.tokenize(text, add_special=False) != model.tokenize(text, add_special=False,
                                                                                      parse_special=False):
                raise BadRequest(f"{param} hold the text of a control token of the model", param=param)

    def _tool_grammar(self, request: CompletionRequest) -> GrammarSpec | None:
        """The request's grammar where it has tools: the call's, when one is due (tool_choice required or a named
        function); BadRequest for a template that cannot take them."""
        model, use = self.model, request.tool_use
        try:
            format_ = call_format(model.chat_template())
        except ToolError as error:
            raise BadRequest(str(error), param=error.param) from error
        if not use.required:
            return request.grammar
        if request.grammar:
            raise BadRequest("a required tool call and a response format cannot both hold: send one",
                             param="tool_choice")
        return GrammarSpec("lark", call_grammar(use.callable, use.parallel, format_, self._token_of), "tools")

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
            raise too_long(f"the prompt has {len(request.prompt_tokens)} tokens; the context holds "
                           f"{self.context_size}")
        if len(request.messages) >= self.context_size:
            raise too_long(f"{len(request.messages)} messages cannot fit a context of {self.context_size} tokens",
                           param="messages")
        texts = [request.prompt] + [str(message.get("content", "")) for message in request.messages]
        if sum(len(text) for text in texts) > self.max_prompt_bytes:  # characters: at least one byte each
            raise too_long(f"the prompt is far longer than the context of {self.context_size} tokens")

    def check_text_size(self, text: str, param: str) -> None:
        """BadRequest for a text to tokenize that has more characters than the context's tokens could spell."""
        if len(text) > self.max_prompt_bytes:
            raise too_long(f"{param} is far longer than the context of {self.context_size} tokens", param=param)

    def _check_prompt(self, tokens: list[int]) -> None:
        if not tokens:
            raise BadRequest("the prompt is empty", param="prompt")
        n_vocab = self.model.n_vocab
        if not all(0 <= token < n_vocab for token in tokens):
            raise BadRequest(f"prompt token ids must be between 0 and {n_vocab - 1}", param="prompt")
        if len(tokens) >= self.context_size:
            raise too_long(f"the prompt has {len(tokens)} tokens; the context holds {self.context_size}, "
                           "which must leave room for at least one new token")
