"""ggml's device backends and RPC servers: which devices this llama.cpp build has, offloading layers to
them, and serving a device to other machines. With duo.llama.model, the only code that touches llama.cpp."""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.metadata
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

from duo.llama.errors import ModelError

log = logging.getLogger("duo.llama.backends")

DEVICES = ("cpu", "cuda", "metal", "vulkan", "auto")

# ggml backend registry names for each --device choice.
_BACKEND_NAMES = {"cuda": ("CUDA", "ROCm", "HIP", "MUSA"), "metal": ("Metal", "MTL"), "vulkan": ("Vulkan",)}
_BUILD_FLAGS = {"cuda": "-DGGML_CUDA=on", "metal": "-DGGML_METAL=on", "vulkan": "-DGGML_VULKAN=on"}
_NO_DEVICE_CAUSES = {
    "cuda": "no NVIDIA/AMD GPU is visible to this process: check nvidia-smi, CUDA_VISIBLE_DEVICES (empty hides "
            "every GPU) and, in a container, that it was started with the GPUs (docker run --gpus all)",
    "metal": "Metal finds no GPU on this machine",
    "vulkan": "no Vulkan driver offers a device: check vulkaninfo and the GPU's Vulkan driver (ICD)",
}


@functools.cache
def llama() -> ModuleType:
    """llama_cpp, imported when a model or device is first needed rather than when duo is: `--help`, `duo
    models` and the flag checks must work even where the build's own libraries cannot be loaded (a CUDA
    build on a machine without the CUDA runtime), and that failure is then a clear error."""
    try:
        return importlib.import_module("llama_cpp")
    except (ImportError, OSError) as error:
        raise ModelError(f"llama-cpp-python cannot be loaded: {error}. A GPU build needs its runtime libraries "
                         "(CUDA: the toolkit's libcudart and libcublas); run scripts/setup.sh again to rebuild") from error


def reinstall_hint(device: str) -> str:
    """A reinstall that works: pinned to the installed version (pyproject.toml's pin), without dependencies,
    keeping ggml's RPC backend."""
    flags = _BUILD_FLAGS[device]
    return (f"Rebuild it with {device} support: CMAKE_ARGS=\"{flags}\" scripts/setup.sh in duo's checkout, or "
            f"CMAKE_ARGS=\"-DGGML_RPC=on {flags}\" pip install --force-reinstall --no-deps --no-cache-dir "
            f"llama-cpp-python=={importlib.metadata.version('llama-cpp-python')}; or use --device cpu")


def backend_devices() -> dict[str, int]:
    """Each ggml backend this llama.cpp build registered, with the number of devices it found, e.g.
    {'CUDA': 1, 'RPC': 0, 'CPU': 1}. A backend is registered even when it finds no device (CUDA with no
    driver or CUDA_VISIBLE_DEVICES=""), so the count is what tells whether a GPU is really there."""
    ggml = _ggml_library()
    if ggml is None:  # no registry to ask: trust the build's own list
        info = llama().llama_print_system_info().decode(errors="replace")
        return {part.split(" : ")[0].strip(): 1 for part in info.split(" | ") if " : " in part}
    _declare_registry(ggml)
    registries = [ggml.ggml_backend_reg_get(i) for i in range(ggml.ggml_backend_reg_count())]
    return {ggml.ggml_backend_reg_name(reg).decode(): ggml.ggml_backend_reg_dev_count(reg) for reg in registries}


def available_backends() -> list[str]:
    """Names of the ggml backends this llama.cpp build registered (e.g. ['CPU'] or ['CUDA', 'CPU'])."""
    return list(backend_devices())


NO_RPC = ("this llama-cpp-python was built without ggml's RPC backend: run scripts/setup.sh, which builds it "
          "with CMAKE_ARGS=-DGGML_RPC=on")
_GGML_CPU_DEVICE, _GGML_GPU_DEVICE = 0, 1  # enum ggml_backend_dev_type


def rpc_supported() -> bool:
    return bool(llama().llama_supports_rpc())


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
    handshake, so check that the server answers first (duo.llama.rpc.check_reachable)."""
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
    lib_dir = Path(llama().__file__).parent / "lib"
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
    return layers_for_devices(device, n_gpu_layers, backend_devices())


def layers_for_devices(device: str, n_gpu_layers: int | None, backends: dict[str, int]) -> int:
    """gpu_layers_for on a given registry (backend name -> devices found): -1 is every layer."""
    if device not in DEVICES:
        raise ModelError(f"unknown device {device!r}: choose one of {', '.join(DEVICES)}")
    if device == "cpu":
        return 0
    every = -1 if n_gpu_layers is None else n_gpu_layers
    if device == "auto":
        has_gpu = any(count and name.startswith(_BACKEND_NAMES[kind])
                      for kind in _BACKEND_NAMES for name, count in backends.items())
        return every if has_gpu else 0
    built = {name: count for name, count in backends.items() if name.startswith(_BACKEND_NAMES[device])}
    if not built:
        raise ModelError(f"--device {device}: this llama-cpp-python build has no {device} backend (it has: "
                         f"{', '.join(backends) or 'none'}). {reinstall_hint(device)}")
    if not any(built.values()):
        raise ModelError(f"--device {device}: the {'/'.join(built)} backend is built in but found no device: "
                         f"{_NO_DEVICE_CAUSES[device]}. Or use --device cpu")
    return every


def amx_compiled(system_info: str) -> bool:
    """Whether llama.cpp was compiled with ggml's AMX kernels (its system info lists AMX_INT8 = 1)."""
    return any(part.strip().replace(" ", "") == "AMX_INT8=1" for part in system_info.replace(":", "|").split("|"))


def extra_buffers_safe() -> bool:
    """Whether models may use ggml's extra CPU buffer types (weight repacking). With the AMX kernels compiled
    in, one of them is the AMX buffer, whose matrix multiply crashes on batches of 2 to 8 tokens (llama.cpp
    issue 20824), duo's verify batches: scripts/setup.sh builds without them, and a llama-cpp-python built
    elsewhere (-march=native on a Xeon) loads its models without extra buffers instead, slower but whole."""
    info = llama().llama_print_system_info().decode(errors="replace")
    if not amx_compiled(info):
        return True
    log.warning("this llama-cpp-python has ggml's AMX kernels, which crash on 2-8 token batches (llama.cpp issue "
                "20824): loading without extra CPU buffer types. Rebuild with scripts/setup.sh for full speed")
    return False


def describe_devices() -> list[str]:
    """'NAME (description, free/total GiB)' for each GPU or RPC device that layers may go to."""
    ggml = _ggml_library()
    if ggml is None:
        return []
    _declare_registry(ggml)
    found = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        if ggml.ggml_backend_dev_type(dev) == _GGML_CPU_DEVICE:
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        found.append(f"{ggml.ggml_backend_dev_name(dev).decode()} ({ggml.ggml_backend_dev_description(dev).decode()}, "
                     f"{free.value / 2**30:.1f} GiB free of {total.value / 2**30:.1f})")
    return found


def _declare_registry(ggml: ctypes.CDLL) -> None:
    """The C signatures of ggml's backend and device registry (ctypes would truncate pointers to int)."""
    for name, restype, argtypes in (
            ("ggml_backend_reg_count", ctypes.c_size_t, []),
            ("ggml_backend_reg_get", ctypes.c_void_p, [ctypes.c_size_t]),
            ("ggml_backend_reg_name", ctypes.c_char_p, [ctypes.c_void_p]),
            ("ggml_backend_reg_dev_count", ctypes.c_size_t, [ctypes.c_void_p]),
            ("ggml_backend_dev_count", ctypes.c_size_t, []),
            ("ggml_backend_dev_get", ctypes.c_void_p, [ctypes.c_size_t]),
            ("ggml_backend_dev_type", ctypes.c_int, [ctypes.c_void_p]),
            ("ggml_backend_dev_name", ctypes.c_char_p, [ctypes.c_void_p]),
            ("ggml_backend_dev_description", ctypes.c_char_p, [ctypes.c_void_p]),
            ("ggml_backend_dev_memory", None, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                               ctypes.POINTER(ctypes.c_size_t)])):
        function = getattr(ggml, name)
        function.restype, function.argtypes = restype, argtypes
