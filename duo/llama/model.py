"""The model layer: load a GGUF, tokenize, render chat templates, open KV caches on it (duo.llama.context).

With duo.llama.backends and duo.llama.context, the only code that touches llama.cpp."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from jinja2 import TemplateError

from duo.llama.backends import add_rpc_server, describe_devices, extra_buffers_safe, gpu_layers_for, llama
from duo.llama.context import Context
from duo.llama.errors import ModelError
from duo.llama.templates import ChatTemplate
from duo.llama.vocab import Vocab

# Sequences one context may hold (llama.cpp's LLAMA_MAX_SEQ, which its Python binding does not export).
MAX_SEQUENCES = 256
# Tokens per llama_decode call (llama.cpp's default n_batch): a verify batch must fit in one.
N_BATCH = 512


class Model:
    """A GGUF model loaded on a device; owns the native llama_model and hands out sequence contexts."""

    def __init__(self, path: str | os.PathLike, *, device: str = "cpu", n_gpu_layers: int | None = None,
                 threads: int | None = None, verbose: bool = False, rpc: Sequence[str] = (),
                 tensor_split: Sequence[float] = (), chat_template: str | None = None,
                 template_variables: Mapping[str, Any] | None = None) -> None:
        """`rpc`: HOST:PORT of ggml RPC servers to split the layers over (llama.cpp's --rpc): all of them
        by default, else the last n_gpu_layers; `tensor_split`: their proportions per device (default:
        by free memory); `chat_template`: a Jinja chat template used instead of the GGUF's (llama-server's
        --chat-template); `template_variables`: the template's variables where a request sets none of its own
        (llama-server's --reasoning, --chat-template-kwargs)."""
        path = Path(path)
        if not path.is_file():
            raise ModelError(f"model file not found: {path}")
        llama().llama_backend_init()
        if not verbose:
            _silence_llama_log()
        for endpoint in rpc:
            add_rpc_server(endpoint)
        params = llama()._internals.LlamaModel.default_params()
        params.n_gpu_layers = gpu_layers_for(device, n_gpu_layers)
        if rpc and params.n_gpu_layers == 0 and n_gpu_layers != 0:  # no local GPU: the RPC devices take the
            params.n_gpu_layers = -1 if n_gpu_layers is None else n_gpu_layers  # layers (llama.cpp's -ngl, --rpc)
        if tensor_split:
            self._tensor_split = (ctypes.c_float * llama().LLAMA_MAX_DEVICES)(*tensor_split)  # alive while loading
            params.tensor_split = self._tensor_split
        params.use_extra_bufts = extra_buffers_safe()
        self.path = path
        self.device = device
        self.on_gpu = params.n_gpu_layers != 0
        self._n_gpu_layers = params.n_gpu_layers
        self.offload_devices = describe_devices() if self.on_gpu else []
        self.threads = threads or max(1, os.cpu_count() or 1)
        try:
            self._model = llama()._internals.LlamaModel(path_model=str(path), params=params, verbose=verbose)
        except ValueError as error:
            raise ModelError(f"cannot load {path}: {error} (is it a GGUF model file?)") from error
        self._vocab: Vocab | None = None
        self._chat_renderer: ChatTemplate | None = None  # compiled when first asked
        self._chat_template: str | None = chat_template  # None: the GGUF's, read when first asked
        self._template_variables = dict(template_variables or {})
        self._eog: tuple[int, ...] | None = None  # end_of_generation_ids, once walked

    @property
    def native(self) -> Any:
        """llama-cpp-python's LlamaModel (duo.llama.context opens KV caches on it)."""
        return self._model

    @property
    def n_layer(self) -> int:
        return llama().llama_model_n_layer(self._model.model)

    @property
    def layers_offloaded(self) -> int:
        """Repeating layers held by a GPU or RPC device (llama.cpp offloads the last n_gpu_layers)."""
        wanted = self._n_gpu_layers
        return self.n_layer if wanted < 0 else min(wanted, self.n_layer)

    def placement(self) -> str:
        """Where the model runs, for the start-up log: devices, layers offloaded, threads."""
        where = ", ".join(self.offload_devices) if self.offload_devices else "CPU"
        return (f"{self.description} on {where}: {self.layers_offloaded}/{self.n_layer} layers offloaded, "
                f"{self.threads} thread{'s' if self.threads != 1 else ''}")

    @property
    def n_vocab(self) -> int:
        return self._model.n_vocab()

    @property
    def n_ctx_train(self) -> int:
        return self._model.n_ctx_train()

    @property
    def description(self) -> str:
        return self._model.desc()

    def meta(self) -> dict[str, int]:
        """llama-server's model meta (/v1/models), whose n_ctx_train clients size their prompts by."""
        m = self._model
        return {"vocab_type": m.vocab_type(), "n_vocab": self.n_vocab,
                "n_ctx_train": m.n_ctx_train(), "n_embd": m.n_embd(), "n_params": m.n_params(), "size": m.size()}

    @property
    def can_rollback(self) -> bool:
        """Recurrent and hybrid models keep a running state that cannot be cut back to a position."""
        return not (llama().llama_model_is_recurrent(self._model.model)
                    or llama().llama_model_is_hybrid(self._model.model))

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama().llama_vocab_is_eog(self._model.vocab, token))

    def end_of_generation_ids(self) -> list[int]:
        """Every end-of-generation token: one native call a token of the vocabulary, so walked once."""
        if self._eog is None:
            self._eog = tuple(token for token in range(self.n_vocab) if self.is_end_of_generation(token))
        return list(self._eog)

    def special_token(self, name: str) -> int | None:
        """The vocabulary's `name` token (eot, eos, fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep); None where
        it has none (llama.cpp also finds FIM tokens by their text: Qwen's <|fim_prefix|>, CodeLlama's <PRE>, ...)."""
        token = getattr(llama(), f"llama_vocab_{name}")(self._model.vocab)
        return None if token < 0 else int(token)

    def llama_vocab(self) -> Any:
        """The native llama_vocab pointer (for llguidance's tokenizer: duo.constraint)."""
        return self._model.vocab

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Text to ids; `add_special` adds BOS where the model's metadata asks for it."""
        return self._model.tokenize(text.encode("utf-8"), add_special and self._model.add_bos_token(),
                                    parse_special)

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> bytes:
        """Ids to bytes (a character may span tokens, so this is bytes, not str)."""
        return b"".join(self.token_piece(token, special=special) for token in tokens)

    def token_piece(self, token: int, *, special: bool = False) -> bytes:
        size = 64
        while True:
            buffer = ctypes.create_string_buffer(size)
            n = llama().llama_token_to_piece(self._model.vocab, token, buffer, size, 0, special)
            if n >= 0:
                return buffer.raw[:n]
            size = -n

    def chat_template(self) -> str:
        """The GGUF's chat template ("" for none), read once: each tool request asks for it twice."""
        if self._chat_template is None:
            self._chat_template = self._model.metadata().get("tokenizer.chat_template") or ""
        return self._chat_template

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = (),
                    variables: Mapping[str, Any] | None = None, *, generation_prompt: bool = True) -> str:
        """The chat (tools, the client's template `variables` over the launch line's) rendered by the chat template,
        ending with the opening of the assistant's answer where `generation_prompt` (the template's
        add_generation_prompt)."""
        try:
            return self._chat_formatter().render(messages, tools, variables, add_generation_prompt=generation_prompt)
        except (TemplateError, ValueError, TypeError) as error:
            # raise_exception (roles out of order) raises ValueError; a malformed template TemplateError; one that
            # adds a string to a number, TypeError.
            raise ModelError(f"the model's chat template rejected the messages: {error}") from error

    def _chat_formatter(self) -> ChatTemplate:
        """The chat template's renderer, compiled once."""
        if self._chat_renderer is None:
            template = self.chat_template()
            if not template:
                raise ModelError(f"{self.path.name} has no chat template; send a raw prompt instead")
            self._chat_renderer = ChatTemplate(
                template, defaults=self._template_variables,
                eos_token=self.token_piece(self._model.token_eos(), special=True).decode(errors="replace"),
                bos_token=self.token_piece(self._model.token_bos(), special=True).decode(errors="replace"))
        return self._chat_renderer

    def vocab(self) -> Vocab:
        if self._vocab is None:
            vocab, text_of = self._model.vocab, llama().llama_vocab_get_text
            self._vocab = Vocab(
                vocab_type=self._model.vocab_type(),
                bos=self._model.token_bos(),
                eos=self._model.token_eos(),
                add_bos=self._model.add_bos_token(),
                add_eos=self._model.add_eos_token(),
                token_texts=tuple(text_of(vocab, i) or b"" for i in range(self.n_vocab)),
            )
        return self._vocab

    def warm_up(self) -> None:
        """Decode once so that the first request does not pay llama.cpp's one-time set-up (weight
        repacking, buffer allocation), which otherwise costs about a second."""
        context = self.new_context(64)
        context.decode([self.vocab().eos], 0)
        context.close()

    def new_context(self, n_ctx: int, *, n_batch: int = N_BATCH, n_seq: int = 1, cells: int | None = None,
                    flash_attn: bool | None = None) -> Context:
        return Context(self, n_ctx=n_ctx, n_batch=n_batch, n_seq=n_seq, cells=cells, flash_attn=flash_attn)

    def close(self) -> None:
        self._model.close()


_LOG_CALLBACK = None


def _silence_llama_log() -> None:
    """llama.cpp logs every load to stderr; keep errors only."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is not None:
        return

    @llama().llama_log_callback
    def log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        if level == 4:  # GGML_LOG_LEVEL_ERROR
            sys.stderr.write(text.decode(errors="replace"))

    _LOG_CALLBACK = log
    llama().llama_log_set(log, ctypes.c_void_p(0))
