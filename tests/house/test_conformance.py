"""scripts/conformance.sh's pieces: the stand-in llama-server's mapping of the suite's models and flags, the
expectations file's form, and the report that fails on a test off the expectations."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from conformance import (DUO_EXTRA, draft_for, duo_arguments, local_model, read_expectations,  # noqa: E402
                         report, split_model_flags)

ENV = {"DUO_CONFORMANCE_TINY": "/m/tiny.gguf", "DUO_CONFORMANCE_TINY_DRAFT": "/m/tiny-draft.gguf",
       "DUO_CONFORMANCE_CHAT": "/m/qwen-0.5b.gguf", "DUO_CONFORMANCE_CHAT_DRAFT": "/m/qwen-0.5b-q4.gguf"}
EXPECTED = ROOT / "scripts" / "conformance-expected.txt"


@pytest.mark.parametrize("argv", [
    ["--hf-repo", "ggml-org/test-model-stories260K"],
    ["--hf-repo", "ggml-org/test-model-stories260K-infill"],
    ["--hf-repo", "ggml-org/stories15M_MOE", "--hf-file", "stories15M_MOE-F16.gguf"],
    ["--hf-repo", "ggml-org/models", "--hf-file", "tinyllamas/split/stories15M-q8_0-00001-of-00003.gguf"],
    ["--hf-repo", "ggml-org/tinygemma3-GGUF:Q8_0"],
])
def test_the_suites_tiny_models_are_served_by_the_tiny_stand_in(argv):
    flags, _, rest = split_model_flags(["--port", "8080", *argv, "--temp", "0.8"])
    assert local_model(flags, ENV) == ENV["DUO_CONFORMANCE_TINY"]
    assert rest == ["--port", "8080", "--temp", "0.8"]


@pytest.mark.parametrize("argv", [
    ["--hf-repo", "bartowski/Phi-3.5-mini-instruct-GGUF:Q4_K_M"],
    ["--hf-repo", "ggml-org/Qwen2.5-Coder-1.5B-IQ3_XXS-GGUF", "--hf-file", "qwen2.5-coder-1.5b-iq3_xxs-imat.gguf"],
    ["--model-url", "https://huggingface.co/bartowski/Meta-Llama-3.1-8B-Instruct-GGUF/x.gguf"],
])
def test_every_real_chat_model_is_served_by_the_chat_stand_in_with_its_own_draft(argv):
    flags, _, _ = split_model_flags(argv)
    model = local_model(flags, ENV)
    assert model == ENV["DUO_CONFORMANCE_CHAT"]
    assert draft_for(model, ENV) == ENV["DUO_CONFORMANCE_CHAT_DRAFT"]


def test_a_model_path_that_exists_is_served_as_it_is(tmp_path):
    model = tmp_path / "stories15M-q4_0.gguf"
    model.write_bytes(b"GGUF")
    flags, draft, _ = split_model_flags(["-m", str(model), "--model-draft", str(model)])
    assert local_model(flags, ENV) == str(model)
    assert draft == str(model)


def test_duo_target_gets_llama_servers_flags_less_those_the_stand_in_drops():
    rest = ["--port", "8081", "--temp", "0.8", "--no-slots", "--no-jinja", "--spec-type", "draft-simple",
            "--ctx-size", "512"]
    assert duo_arguments(rest) == ["--port", "8081", "--temp", "0.8", "--no-slots", "--ctx-size", "512", *DUO_EXTRA]


def test_an_explicit_parallel_keeps_llama_servers_meaning_of_the_context():
    assert "--no-kv-unified" in duo_arguments(["--ctx-size", "512", "--parallel", "2"])
    assert "--no-kv-unified" not in duo_arguments(["--ctx-size", "512", "--parallel", "2", "--kv-unified"])
    assert "--no-kv-unified" not in duo_arguments(["--ctx-size", "512"])


def test_the_expectations_give_each_test_one_of_the_two_reasons_allowed():
    tests, files = read_expectations(EXPECTED)
    assert files, "the files of features duo does not have are listed"
    for test, reason in {**tests, **files}.items():
        assert reason.startswith(("feature: ", "model: ")), f"{test}: {reason!r}"
    for test in tests:
        assert test.split("::")[0] not in files, f"{test} is in a file that is not run"


def junit(path: Path, cases: dict[str, str]) -> Path:
    """A --junitxml file of `cases` ({test name in unit/test_x.py: passed or failed})."""
    body = "".join(f'<testcase classname="unit.test_x" name="{name}">'
                   + ("<failure message='x'/>" if outcome == "failed" else "") + "</testcase>"
                   for name, outcome in cases.items())
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite>{body}</testsuite></testsuites>')
    return path


def test_the_report_fails_only_on_a_test_off_the_expectations(tmp_path, capsys):
    expected = tmp_path / "expected.txt"
    expected.write_text("unit/test_x.py::test_b[a b] | model: asserts the stories model's words\n"
                        "unit/test_y.py | feature: embeddings\n")
    assert report(junit(tmp_path / "ok.xml", {"test_a": "passed", "test_b[a b]": "failed"}), expected) == 0
    table = capsys.readouterr().out
    assert "unit/test_x.py" in table and "not run: unit/test_y.py (feature: embeddings)" in table
    assert report(junit(tmp_path / "bad.xml", {"test_a": "failed", "test_b[a b]": "failed"}), expected) == 1
    assert "FAILED, not expected: unit/test_x.py::test_a" in capsys.readouterr().out
