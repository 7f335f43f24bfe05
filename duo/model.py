"""The model layer, the only code that touches llama.cpp: load a GGUF, tokenize, decode with logits, roll back."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
from jinja2 import TemplateError

import llama_cpp
from llama_cpp import _internals
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

DEVICES = ("cpu", "cuda", "metal", "vulkan", "auto")

# ggml backend registry names for each --device choice.
_BACKEND_NAMES = {"cuda": ("CUDA", "ROCm", "HIP", "MUSA"), "metal": ("Metal", "MTL"), "vulkan": ("Vulkan",)}
_BUILD_FLAGS = {"cuda": "-DGGML_CUDA=on", "metal": "-DGGML_METAL=on", "vulkan": "-DGGML_VULKAN=on"}

# llama.cpp's rules for a draft/target pair (common/speculative.cpp): the first few ids are
# control tokens that may legitimately differ, and a few extra tokens at the end are tolerated.
VOCAB_CHECK_START_ID = 5
VOCAB_MAX_SIZE_DIFFERENCE = 128


class ModelError(Exception):
    """A model cannot be loaded or used as asked; the message says what to change."""


class IncompatibleVocab(ModelError):
    """A draft model's vocabulary does not match the target's."""


@dataclass(frozen=True)
class Vocab:
    """What a draft/target pair must agree on, with the full token texts for a precise diagnosis."""

    vocab_type: int
    bos: int
    eos: int
    add_bos: bool
    add_eos: bool
    token_texts: tuple[bytes, ...]

    @property
    def n_vocab(self) -> int:
        return len(self.token_texts)


def check_compatible(target: Vocab, draft: Vocab) -> None:
    """Raise IncompatibleVocab unless `draft` may draft for `target` under llama.cpp's rules."""
    if target.vocab_type != draft.vocab_type:
        raise IncompatibleVocab(
            f"vocabulary types differ: target {target.vocab_type}, draft {draft.vocab_type}")
    if target.add_bos != draft.add_bos or (target.add_bos and target.bos != draft.bos):
        raise IncompatibleVocab(
            f"BOS differs: target add_bos={target.add_bos} id={target.bos}, "
            f"draft add_bos={draft.add_bos} id={draft.bos}")
    if target.add_eos != draft.add_eos or (target.add_eos and target.eos != draft.eos):
        raise IncompatibleVocab(
            f"EOS differs: target add_eos={target.add_eos} id={target.eos}, "
            f"draft add_eos={draft.add_eos} id={draft.eos}")
    size_difference = abs(target.n_vocab - draft.n_vocab)
    if size_difference > VOCAB_MAX_SIZE_DIFFERENCE:
        raise IncompatibleVocab(
            f"vocabulary sizes differ by {size_difference} (target {target.n_vocab}, draft "
            f"{draft.n_vocab}); at most {VOCAB_MAX_SIZE_DIFFERENCE} is allowed")
    n_common = min(target.n_vocab, draft.n_vocab)
    for token_id in range(VOCAB_CHECK_START_ID, n_common):
        if target.token_texts[token_id] != draft.token_texts[token_id]:
            raise IncompatibleVocab(
                f"token {token_id} differs: target {target.token_texts[token_id]!r}, "
                f"draft {draft.token_texts[token_id]!r}; the draft must use the target's tokenizer")


def available_backends() -> list[str]:
    """Names of the ggml backends this llama.cpp build registered (e.g. ['CPU'] or ['CUDA', 'CPU'])."""
    ggml = _ggml_library()
    if ggml is None:
        info = llama_cpp.llama_print_system_info().decode(errors="replace")
        return [part.split(" : ")[0].strip() for part in info.split(" | ") if " : " in part]
    ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
    ggml.ggml_backend_reg_get.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_get.argtypes = [ctypes.c_size_t]
    ggml.ggml_backend_reg_name.restype = ctypes.c_char_p
    ggml.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    return [ggml.ggml_backend_reg_name(ggml.ggml_backend_reg_get(i)).decode()
            for i in range(ggml.ggml_backend_reg_count())]


NO_RPC = ("this llama-cpp-python was built without ggml's RPC backend: run scripts/setup.sh, which builds it "
          "with CMAKE_ARGS=-DGGML_RPC=on")
_GGML_CPU_DEVICE, _GGML_GPU_DEVICE = 0, 1  # enum ggml_backend_dev_type


def rpc_supported() -> bool:
    return bool(llama_cpp.llama_supports_rpc())


def _rpc_function(name: str, restype: type | None, *argtypes: type) -> Callable:
    """A function of ggml's RPC backend, found through the backend registry as llama.cpp's --rpc finds
    it (the RPC library's own symbols are not always visible to ctypes)."""
    ggml = _ggml_library()
    if ggml is None or not rpc_supported():
        raise ModelError(NO_RPC)
    ggml.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    address = ggml.ggml_backend_reg_get_proc_address(ggml.ggml_backend_reg_by_name(b"RPC"), name.encode())
    if not address:
        raise ModelError(f"{NO_RPC} ({name} is missing)")
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)


def add_rpc_server(endpoint: str) -> None:
    """Register the devices of the ggml RPC server at HOST:PORT, as llama.cpp's --rpc does: models
    loaded afterwards offload their layers to them. ggml aborts the process when it cannot connect or
    handshake, so check that the server answers first (duo.rpc.check_reachable)."""
    registry = _rpc_function("ggml_backend_rpc_add_server", ctypes.c_void_p, ctypes.c_char_p)(endpoint.encode())
    if not registry:
        raise ModelError(f"the RPC server at {endpoint} offers no device")
    ggml = _ggml_library()
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_register(registry)


def serve_rpc(endpoint: str, *, device: str, threads: int, cache_dir: str | None) -> None:
    """Serve this machine's `device` ("cpu" or a GPU) to llama.cpp RPC clients at HOST:PORT; returns
    only if the server cannot start (the address is taken, say)."""
    ggml = _ggml_library()
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    handle = ggml.ggml_backend_dev_by_type(_GGML_CPU_DEVICE if device == "cpu" else _GGML_GPU_DEVICE)
    if not handle:
        raise ModelError(f"no {device} device in this llama-cpp-python build (it has: {', '.join(available_backends())})")
    start = _rpc_function("ggml_backend_rpc_start_server", None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                          ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p))
    start(endpoint.encode(), cache_dir.encode() if cache_dir else None, threads, 1, (ctypes.c_void_p * 1)(handle))


def on_native_abort(handler: Callable[[str], None]) -> None:
    """Call handler(message) where llama.cpp would abort the process (a lost RPC server, say). If the
    handler returns, the process aborts; it may instead block its thread and end the process itself."""
    global _ABORT_CALLBACK
    ggml = _ggml_library()
    if ggml is None:
        return
    _ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)(lambda message: handler(message.decode(errors="replace")))
    ggml.ggml_set_abort_callback.argtypes = [ctypes.c_void_p]
    ggml.ggml_set_abort_callback(ctypes.cast(_ABORT_CALLBACK, ctypes.c_void_p))


_ABORT_CALLBACK = None  # kept alive while ggml holds it


@functools.cache
def _ggml_library() -> ctypes.CDLL | None:
    """The ggml library llama.cpp itself uses. Its soname comes first: the same file opened under
    another name (libggml.so for libggml.so.0) is a second copy of ggml with a backend registry of its
    own, where RPC servers registered would stay invisible to llama.cpp."""
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    names = {"darwin": ["libggml.0.dylib", "libggml.dylib"], "win32": ["ggml.dll"]}
    for name in names.get(sys.platform, ["libggml.so.0", "libggml.so"]):
        if (lib_dir / name).exists():
            try:
                return ctypes.CDLL(str(lib_dir / name))
            except OSError:
                return None
    return None


def gpu_layers_for(device: str, n_gpu_layers: int | None) -> int:
    """How many layers to offload for `device`; a GPU this build cannot use is an error, never a fallback."""
    if device not in DEVICES:
        raise ModelError(f"unknown device {device!r}: choose one of {', '.join(DEVICES)}")
    if device == "cpu":
        return 0
    backends = available_backends()
    if device == "auto":
        has_gpu = any(name.startswith(_BACKEND_NAMES[kind]) for kind in _BACKEND_NAMES for name in backends)
        return (-1 if n_gpu_layers is None else n_gpu_layers) if has_gpu else 0
    if not any(name.startswith(_BACKEND_NAMES[device]) for name in backends):
        raise ModelError(
            f"--device {device}: this llama-cpp-python build has no {device} backend (it has: "
            f"{', '.join(backends) or 'none'}). Reinstall it with GPU support: CMAKE_ARGS=\"{_BUILD_FLAGS[device]}\" "
            "pip install --force-reinstall --no-cache-dir llama-cpp-python, or use --device cpu")
    return -1 if n_gpu_layers is None else n_gpu_layers


class Model:
    """A GGUF model loaded on a device; owns the native llama_model and hands out sequence contexts."""

    def __init__(self, path: str | os.PathLike, *, device: str = "cpu", n_gpu_layers: int | None = None,
                 threads: int | None = None, verbose: bool = False, rpc: Sequence[str] = (),
                 tensor_split: Sequence[float] = ()) -> None:
        """`rpc`: HOST:PORT of ggml RPC servers to split the layers over (llama.cpp's --rpc): all of them
        by default, else the last n_gpu_layers; `tensor_split`: their proportions per device (default:
        by free memory)."""
        path = Path(path)
        if not path.is_file():
            raise ModelError(f"model file not found: {path}")
        llama_cpp.llama_backend_init()
        if not verbose:
            _silence_llama_log()
        for endpoint in rpc:
            add_rpc_server(endpoint)
        params = _internals.LlamaModel.default_params()
        params.n_gpu_layers = gpu_layers_for(device, n_gpu_layers)
        if rpc and params.n_gpu_layers == 0 and n_gpu_layers != 0:  # no local GPU: the RPC devices take the
            params.n_gpu_layers = -1 if n_gpu_layers is None else n_gpu_layers  # layers (llama.cpp's -ngl, --rpc)
        if tensor_split:
            self._tensor_split = (ctypes.c_float * llama_cpp.LLAMA_MAX_DEVICES)(*tensor_split)  # alive while loading
            params.tensor_split = self._tensor_split
        self.path = path
        self.device = device
        self.on_gpu = params.n_gpu_layers != 0
        self.threads = threads or max(1, os.cpu_count() or 1)
        try:
            self._model = _internals.LlamaModel(path_model=str(path), params=params, verbose=verbose)
        except ValueError as error:
            raise ModelError(f"cannot load {path}: {error} (is it a GGUF model file?)") from error
        self._vocab: Vocab | None = None
        self._chat_formatter: Jinja2ChatFormatter | None = None

    @property
    def n_vocab(self) -> int:
        return self._model.n_vocab()

    @property
    def n_ctx_train(self) -> int:
        return self._model.n_ctx_train()

    @property
    def description(self) -> str:
        return self._model.desc()

    @property
    def can_rollback(self) -> bool:
        """Recurrent and hybrid models keep a running state that cannot be cut back to a position."""
        return not (llama_cpp.llama_model_is_recurrent(self._model.model)
                    or llama_cpp.llama_model_is_hybrid(self._model.model))

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._model.vocab, token))

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
            n = llama_cpp.llama_token_to_piece(self._model.vocab, token, buffer, size, 0, special)
            if n >= 0:
                return buffer.raw[:n]
            size = -n

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> str:
        """Render chat messages with the GGUF's own chat template, ready for the assistant's turn."""
        if self._chat_formatter is None:
            template = self._model.metadata().get("tokenizer.chat_template")
            if not template:
                raise ModelError(f"{self.path.name} has no chat template; send a raw prompt instead")
            self._chat_formatter = Jinja2ChatFormatter(
                template=template,
                eos_token=self.token_piece(self._model.token_eos(), special=True).decode(errors="replace"),
                bos_token=self.token_piece(self._model.token_bos(), special=True).decode(errors="replace"),
            )
        try:
            return self._chat_formatter(messages=[dict(m) for m in messages]).prompt
        except TemplateError as error:  # the template's own raise_exception, e.g. roles out of order
            raise ModelError(f"the model's chat template rejected the messages: {error}") from error

    def vocab(self) -> Vocab:
        if self._vocab is None:
            vocab = self._model.vocab
            self._vocab = Vocab(
                vocab_type=self._model.vocab_type(),
                bos=self._model.token_bos(),
                eos=self._model.token_eos(),
                add_bos=self._model.add_bos_token(),
                add_eos=self._model.add_eos_token(),
                token_texts=tuple(llama_cpp.llama_vocab_get_text(vocab, i) or b""
                                  for i in range(self.n_vocab)),
            )
        return self._vocab

    def warm_up(self) -> None:
        """Decode once so that the first request does not pay llama.cpp's one-time set-up (weight
        repacking, buffer allocation), which otherwise costs about a second."""
        context = self.new_context(64)
        context.decode([self.vocab().eos], 0)
        context.close()

    def new_context(self, n_ctx: int, *, n_batch: int = 512, n_seq: int = 1) -> "Context":
        return Context(self, n_ctx=n_ctx, n_batch=n_batch, n_seq=n_seq)

    def close(self) -> None:
        self._model.close()


class Context:
    """A KV cache on a model: decode tokens at absolute positions, roll back to a position.

    Sequence 0 is the main one. With n_seq > 1, other sequences can fork from its prefix at no cost
    (llama.cpp tags the same cache cells with both sequence ids) to decode an alternative
    continuation beside it; all sequences share the one cache of n_ctx cells.
    """

    def __init__(self, model: Model, *, n_ctx: int, n_batch: int, n_seq: int = 1) -> None:
        if n_ctx > model.n_ctx_train:
            n_ctx = model.n_ctx_train
        params = _internals.LlamaContext.default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq
        params.kv_unified = True  # else llama.cpp splits the cells evenly between the sequences
        params.n_threads = model.threads
        params.n_threads_batch = model.threads
        params.no_perf = True
        if not model.on_gpu:
            # Keep a CPU-only model entirely on the CPU even in a GPU build.
            params.offload_kqv = False
            params.op_offload = False
        self.model = model
        try:
            self._ctx = _internals.LlamaContext(model=model._model, params=params, verbose=False)
        except ValueError as error:
            raise ModelError(f"cannot create a context of {n_ctx} tokens: {error}") from error
        # llama.cpp pads the cache to a multiple of 256 but caps a batch at the context size asked for.
        self.n_ctx = n_ctx
        self.n_batch = llama_cpp.llama_n_batch(self._ctx.ctx)
        self._n_past = [0] * n_seq  # sequence s holds positions [0, _n_past[s]) in the KV cache
        self._batch = _internals.LlamaBatch(n_tokens=self.n_batch, embd=0, n_seq_max=1, verbose=False)

    @property
    def n_past(self) -> int:
        """Positions [0, n_past) of the main sequence are in the KV cache."""
        return self._n_past[0]

    def decode(self, tokens: Sequence[int], pos: int, logits_for: Sequence[int] | None = None,
               seq: int = 0) -> np.ndarray:
        """Decode `tokens` at positions pos, pos+1, ... of sequence `seq`; return the logits of the
        batch indices in `logits_for` (default: the last token) as a float32 array [len(logits_for), n_vocab]."""
        if pos != self._n_past[seq]:
            raise ModelError(f"decode at position {pos}, but the KV cache holds {self._n_past[seq]} positions "
                             f"of sequence {seq}")
        if pos + len(tokens) > self.n_ctx:
            raise ModelError(f"context full: {pos} + {len(tokens)} tokens exceed the context of {self.n_ctx}")
        wanted = [len(tokens) - 1] if logits_for is None else list(logits_for)
        rows: list[np.ndarray] = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            outputs = [i - start for i in wanted if start <= i < start + len(chunk)]
            self._fill_batch(chunk, pos + start, outputs, seq)
            try:
                self._ctx.decode(self._batch)
            except RuntimeError as error:
                self.rollback(pos, seq)
                raise ModelError(f"llama_decode failed: {error}") from error
            self._n_past[seq] = pos + start + len(chunk)
            if outputs:
                logits = llama_cpp.llama_get_logits(self._ctx.ctx)
                rows.append(np.ctypeslib.as_array(logits, shape=(len(outputs), self.model.n_vocab)).copy())
        if not rows:
            return np.empty((0, self.model.n_vocab), dtype=np.float32)
        return np.concatenate(rows)

    def _fill_batch(self, tokens: Sequence[int], pos: int, outputs: Sequence[int], seq: int) -> None:
        batch = self._batch.batch
        batch.n_tokens = len(tokens)
        wanted = set(outputs)
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = pos + i
            batch.seq_id[i][0] = seq
            batch.n_seq_id[i] = 1
            batch.logits[i] = i in wanted

    def rollback(self, n: int, seq: int = 0) -> None:
        """Forget positions >= n of sequence `seq` so that decoding can resume at position n."""
        if n >= self._n_past[seq]:
            return
        if not self._ctx.kv_cache_seq_rm(seq, n, -1):
            raise ModelError(
                f"{self.model.path.name} cannot roll its state back to position {n} (recurrent or hybrid "
                "models keep no per-position cache); duo needs an attention-only model")
        self._n_past[seq] = n

    def fork(self, seq: int, n: int) -> None:
        """Make sequence `seq` hold positions [0, n) of the main sequence, and nothing else.

        No recompute: the cells of those positions are tagged with `seq` too. This costs next to
        nothing where re-decoding the prefix would cost a batch of n tokens.
        """
        n = min(n, self.n_past)
        self._ctx.kv_cache_seq_rm(seq, 0, -1)
        self._ctx.kv_cache_seq_cp(0, seq, 0, n)
        self._n_past[seq] = n

    def close(self) -> None:
        self._batch.close()
        self._ctx.close()


_LOG_CALLBACK = None


def _silence_llama_log() -> None:
    """llama.cpp logs every load to stderr; keep errors only."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is not None:
        return

    @llama_cpp.llama_log_callback
    def log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        if level == 4:  # GGML_LOG_LEVEL_ERROR
            sys.stderr.write(text.decode(errors="replace"))

    _LOG_CALLBACK = log
    llama_cpp.llama_log_set(log, ctypes.c_void_p(0))
