"""Every CPU and every GPU build: no AMX crash (the build, the runtime guard, and batches of 2-8 tokens on
quantized weights), devices that are real or an error, set-up that follows its build arguments, and
--help that works where llama.cpp cannot load."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from duo.llama import backends
from duo.llama.backends import amx_compiled, layers_for_devices, llama
from duo.llama.errors import ModelError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import llama_build  # noqa: E402
from llama_build import ALWAYS, NO_AMX, Build, safe_cflags, wanted_build, wheel_action  # noqa: E402

SPR_INFO = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
            "AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")


# ---- AMX: the build, the guard, and the batches that crashed ----

def test_the_installed_llama_cpp_has_no_amx_kernels_or_loads_without_them(caplog):
    info = llama().llama_print_system_info().decode()
    with caplog.at_level(logging.WARNING, logger="duo.llama.backends"):
        safe = backends.extra_buffers_safe()
    assert safe == (not amx_compiled(info)), info
    if not safe:
        assert "issue 20824" in caplog.text


def test_the_guard_reads_amx_from_the_system_info_and_loads_without_extra_buffers(monkeypatch, caplog):
    assert amx_compiled(SPR_INFO)
    assert not amx_compiled(SPR_INFO.replace("AMX_INT8 = 1", "AMX_INT8 = 0"))
    assert not amx_compiled(SPR_INFO.replace("AMX_INT8 = 1 | ", ""))
    assert not amx_compiled("CPU : NEON = 1 | ARM_FMA = 1 | ")
    monkeypatch.setattr(llama(), "llama_print_system_info", lambda: SPR_INFO.encode())
    with caplog.at_level(logging.WARNING, logger="duo.llama.backends"):
        assert backends.extra_buffers_safe() is False
    assert "AMX" in caplog.text and "scripts/setup.sh" in caplog.text


def test_a_model_loaded_under_the_guard_decodes_as_one_loaded_normally(tiny_draft, monkeypatch):
    from duo.llama import model as model_module

    def last_logits() -> object:
        model = model_module.Model(tiny_draft, threads=1)
        try:
            context = model.new_context(64)
            return context.decode(model.tokenize("def main():"), 0)[-1]
        finally:
            model.close()

    normal = last_logits()
    monkeypatch.setattr(model_module, "extra_buffers_safe", lambda: False)
    guarded = last_logits()
    assert abs(guarded - normal).max() < 1e-2 * abs(normal).max()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc to ask")
def test_the_no_amx_flags_remove_amx_from_a_sapphire_rapids_target_whatever_their_order():
    def macros(*flags: str) -> str:
        return subprocess.run(["gcc", *flags, "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True,
                              text=True, check=True).stdout
    assert "__AMX_INT8__" in macros("-march=sapphirerapids")
    for flags in (["-march=sapphirerapids", *NO_AMX.split()], [*NO_AMX.split(), "-march=sapphirerapids"]):
        found = macros(*flags)
        assert "__AMX_INT8__" not in found and "__AMX_TILE__" not in found
        assert "__AVX512VNNI__" in found  # every other instruction of the CPU stays


# The kernels that crashed (llama.cpp issue 20824) ran on quantized weights for batches of 2 to 8 tokens:
# decode every batch size on Q4_K and Q8_0 weights in a child process, so that a crash fails this test (on a
# machine where it would happen) instead of the whole run, and check the rows against one-token decodes.
_BATCHES = textwrap.dedent("""
    import sys
    import numpy as np
    from duo.llama.model import Model
    model = Model(sys.argv[1], threads=1)
    tokens = model.tokenize("def fibonacci(n):\\n    if n < 2:\\n        return n\\n    return fibonacci(n - 1) + "
                            "fibonacci(n - 2)\\n\\nprint(fibonacci(10))")[:32]
    context = model.new_context(256)
    one_by_one = np.concatenate([context.decode([t], i) for i, t in enumerate(tokens)])
    for n in (2, 3, 4, 5, 6, 7, 8, 32):
        context.rollback(0)
        rows = context.decode(tokens[:n], 0, logits_for=range(n))
        error = float(np.abs(rows - one_by_one[:n]).max() / np.abs(one_by_one[:n]).max())
        print(n, error, flush=True)
""")


@pytest.fixture(scope="module")
def quantized_models(tiny_models_dir) -> dict[str, Path]:
    """A tiny model wide enough for k-quants (256), written in F32 then quantized by llama.cpp itself."""
    from duo.models.files import convert_ftype
    from helpers.tiny_models import write_tiny_model

    source = write_tiny_model(tiny_models_dir / "tiny-256-f32.gguf", seed=7, n_embd=256, n_head=4, n_head_kv=2,
                              n_ff=512, embedding_type="f32")
    made = {}
    for ftype in ("MOSTLY_Q4_K_M", "MOSTLY_Q8_0"):
        made[ftype] = tiny_models_dir / f"tiny-256-{ftype.lower()}.gguf"
        if not made[ftype].exists():
            convert_ftype(source, made[ftype], ftype)
    return made


@pytest.mark.parametrize("ftype", ["MOSTLY_Q4_K_M", "MOSTLY_Q8_0"])
def test_quantized_weights_decode_every_verify_batch_size_without_a_crash(quantized_models, ftype):
    done = subprocess.run([sys.executable, "-c", _BATCHES, str(quantized_models[ftype])], capture_output=True,
                          text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, f"exit {done.returncode} (a crash in the matrix kernels?): {done.stderr[-2000:]}"
    errors = {int(n): float(e) for n, e in (line.split() for line in done.stdout.split("\n") if line)}
    assert sorted(errors) == [2, 3, 4, 5, 6, 7, 8, 32]
    # batched rows equal one-token rows up to the rounding of quantized activations
    assert all(error < 0.05 for error in errors.values()), errors


# ---- devices: real or an error ----

def test_a_gpu_backend_with_no_device_is_an_error_naming_the_cause():
    with pytest.raises(ModelError, match="found no device.*CUDA_VISIBLE_DEVICES"):
        layers_for_devices("cuda", None, {"CUDA": 0, "RPC": 0, "CPU": 1})
    with pytest.raises(ModelError, match="found no device.*vulkaninfo"):
        layers_for_devices("vulkan", None, {"Vulkan": 0, "CPU": 1})
    assert layers_for_devices("cuda", None, {"CUDA": 1, "CPU": 1}) == -1
    assert layers_for_devices("cuda", 12, {"CUDA": 2, "CPU": 1}) == 12
    # auto takes a GPU only where one was found
    assert layers_for_devices("auto", None, {"CUDA": 0, "CPU": 1}) == 0
    assert layers_for_devices("auto", None, {"Metal": 1, "CPU": 1}) == -1
    assert layers_for_devices("cpu", None, {"CUDA": 1, "CPU": 1}) == 0


def test_a_missing_gpu_backend_suggests_a_reinstall_that_keeps_rpc_and_the_pinned_version():
    with pytest.raises(ModelError) as refused:
        layers_for_devices("cuda", None, {"RPC": 0, "CPU": 1})
    message = str(refused.value)
    assert "no cuda backend" in message and 'CMAKE_ARGS="-DGGML_CUDA=on" scripts/setup.sh' in message
    assert "-DGGML_RPC=on -DGGML_CUDA=on" in message and "--no-deps" in message
    assert f"llama-cpp-python=={llama_build.VERSION}" in message


def test_the_registry_counts_this_builds_devices():
    found = backends.backend_devices()
    assert found.get("CPU") == 1, found
    assert all(count == 0 for name, count in found.items() if name.startswith(("CUDA", "Vulkan", "Metal"))) or \
        backends.describe_devices()


def test_duo_draft_with_device_cuda_on_a_build_or_machine_without_one_fails_at_start_up(tiny_draft):
    if any(name.startswith("CUDA") and count for name, count in backends.backend_devices().items()):
        pytest.skip("this machine has a CUDA device")
    done = subprocess.run([sys.executable, "-m", "duo.cli.draft", "--model", str(tiny_draft), "--device", "cuda",
                           "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "--device cuda" in done.stderr, done.stderr
    assert "--device cpu" in done.stderr


# ---- set-up: which wheel, from what arguments ----

def test_set_up_keeps_the_installed_build_unless_other_arguments_are_asked_for():
    cpu = Build(llama_build.VERSION, "", NO_AMX)
    cuda = Build(llama_build.VERSION, "-DGGML_CUDA=on", NO_AMX)
    assert wanted_build(None, None, NO_AMX) == cpu  # a first set-up
    assert wanted_build("-DGGML_CUDA=on", cpu, NO_AMX) == cuda  # asked for CUDA: rebuild
    assert wanted_build(None, cuda, NO_AMX) == cuda  # a later plain set-up keeps CUDA
    assert wanted_build("", cuda, NO_AMX) == cpu  # CMAKE_ARGS="" asks for the CPU build again
    assert wanted_build(f"{ALWAYS} -DGGML_CUDA=on", None, NO_AMX) == cuda  # RPC is always there, said or not
    assert "-DGGML_RPC=on" in cuda.all_cmake_args and cuda.key != cpu.key
    assert Build(llama_build.VERSION, "", "").key != cpu.key  # the flags are part of the cache key
    assert wheel_action(cuda, cuda, has_rpc=True, cached=True) == "keep"
    assert wheel_action(cpu, cuda, has_rpc=True, cached=False) == "build"
    assert wheel_action(cpu, cuda, has_rpc=True, cached=True) == "install"
    assert wheel_action(None, cpu, has_rpc=True, cached=True) == "install"  # not duo's build (no record): replace
    assert wheel_action(cpu, cpu, has_rpc=False, cached=True) == "install"


def test_only_x86_builds_get_the_no_amx_flags():
    assert safe_cflags("x86_64", True) == NO_AMX and safe_cflags("AMD64", True) == NO_AMX
    assert safe_cflags("x86_64", False) == "" and safe_cflags("aarch64", True) == "" and safe_cflags("arm64", True) == ""


def test_the_venv_records_the_build_set_up_installed():
    record = llama_build.read_record(ROOT / ".venv" / llama_build.RECORD)
    if record is None:
        pytest.skip("this llama-cpp-python was not installed by scripts/setup.sh")
    assert record.version == llama_build.VERSION
    assert record.cflags == llama_build.this_machines_cflags()


def test_set_up_refuses_an_old_python_before_compiling_anything(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho 'Python 3.8.10'\nexit 1\n")
    fake.chmod(0o755)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake),
                          "HOME": str(tmp_path)}, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "Python 3.10 or newer" in done.stderr, done.stderr


# ---- --help and the model catalog without llama.cpp ----

def test_help_and_models_work_where_llama_cpp_cannot_load_and_a_model_load_says_why(tmp_path, tiny_draft):
    broken = tmp_path / "llama_cpp"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise OSError('libcudart.so.12: cannot open shared object file')\n")
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    for command in (["duo.cli.main", "--help"], ["duo.cli.main", "models", "--help"],
                    ["duo.cli.main", "models", "list"], ["duo.cli.target", "--help"], ["duo.cli.draft", "--help"],
                    ["duo.cli.main", "rpc-server", "--help"], ["duo.cli.main", "bench", "--help"]):
        done = subprocess.run([sys.executable, "-m", *command], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (command, done.stderr)
        assert "usage:" in done.stdout or "models" in done.stdout, command
    done = subprocess.run([sys.executable, "-m", "duo.cli.draft", "--model", str(tiny_draft)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "cannot be loaded" in done.stderr and "libcudart" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr



def test_two_processes_asking_for_llama_server_at_once_build_it_once(tmp_path, monkeypatch):
    """Two pytest workers (or two benches) on a clean cache: the second waits for the first's build and takes its
    binary, instead of compiling the same llama-server beside it for 8 minutes on the same cores."""
    monkeypatch.setattr(llama_build, "CACHE", tmp_path)
    builds, building = [], threading.Event()

    def build_slowly(build: Build, binary: Path) -> None:
        builds.append(binary)
        building.set()
        time.sleep(0.5)  # the other asks meanwhile
        binary.write_text("llama-server")

    monkeypatch.setattr(llama_build, "build_server", build_slowly)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(llama_build.ensure_server, None)
        assert building.wait(10)
        second = pool.submit(llama_build.ensure_server, None)
        assert first.result(10) == second.result(10)
    assert len(builds) == 1 and builds[0].read_text() == "llama-server"
