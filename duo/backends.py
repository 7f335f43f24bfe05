"""ggml's device backends and RPC servers: which devices this llama.cpp build has, offloading layers to
them, and serving a device to other machines. With duo.model, the only code that touches llama.cpp."""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path
from typing import Callable

import llama_cpp

from duo.errors import ModelError

DEVICES = ("cpu", "cuda", "metal", "vulkan", "auto")

# ggml backend registry names for each --device choice.
_BACKEND_NAMES = {"cuda": ("CUDA", "ROCm", "HIP", "MUSA"), "metal": ("Metal", "MTL"), "vulkan": ("Vulkan",)}
_BUILD_FLAGS = {"cuda": "-DGGML_CUDA=on", "metal": "-DGGML_METAL=on", "vulkan": "-DGGML_VULKAN=on"}


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
