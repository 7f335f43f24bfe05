"""scripts/conformance.sh's pieces: the stand-in llama-server's mapping of the suite's models and flags, the
expectations file's form, the report that fails on a test off the expectations (or failing elsewhere than on
llama-server), the lead's refresh of the expectations, and CI running the check."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from conformance.expectations import expected_lines  # noqa: E402
from conformance.results import failure_place, read_expectations, report  # noqa: E402
from conformance.standin import (DUO_EXTRA, Acceptance, draft_for, duo_arguments, local_model,  # noqa: E402
                                 split_model_flags, with_threads)

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


def test_the_expectations_give_each_test_one_of_the_reasons_allowed_and_a_model_test_its_llama_server_place():
    expectations = read_expectations(EXPECTED)
    assert expectations.files, "the files of features duo does not have are listed"
    for test, reason in {**expectations.tests, **expectations.files}.items():
        assert reason.startswith(("feature: ", "model: ", "api: ")), f"{test}: {reason!r}"
    for test, reason in expectations.tests.items():
        assert test.split("::")[0] not in expectations.files, f"{test} is in a file that is not run"
        if reason.startswith("model: "):
            assert expectations.places.get(test), f"{test}: where llama-server fails it is not recorded"


def junit(path: Path, cases: dict[str, str]) -> Path:
    """A --junitxml file of `cases` ({test name in unit/test_x.py: passed, or the line of unit/test_x.py where it
    failed, with pytest's traceback ending there})."""
    body = "".join(f'<testcase classname="unit.test_x" name="{name}">'
                   + ("" if outcome == "passed" else f"<failure message='assert 1 == 2'>&gt;       assert 1 == 2\n"
                                                     f"E       assert 1 == 2\n\nunit/test_x.py:{outcome}: "
                                                     "AssertionError</failure>")
                   + "</testcase>"
                   for name, outcome in cases.items())
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite>{body}</testsuite></testsuites>')
    return path


def test_the_report_fails_only_on_a_test_off_the_expectations(tmp_path, capsys):
    expected = tmp_path / "expected.txt"
    expected.write_text("unit/test_x.py::test_b[a b] | model: asserts the stories model's words\n"
                        "unit/test_y.py | feature: embeddings\n")
    assert report(junit(tmp_path / "ok.xml", {"test_a": "passed", "test_b[a b]": "12"}), expected) == 0
    table = capsys.readouterr().out
    assert "unit/test_x.py" in table and "not run: unit/test_y.py (feature: embeddings)" in table
    assert report(junit(tmp_path / "bad.xml", {"test_a": "40", "test_b[a b]": "12"}), expected) == 1
    assert "FAILED, not expected: unit/test_x.py::test_a" in capsys.readouterr().out


def test_a_failure_is_placed_at_its_innermost_frame_as_pytest_prints_it():
    traceback = ("    def test_x():\n>       helper()\n\nunit/test_x.py:10: \n_ _ _\n"
                 "/venv/lib/python3.11/site-packages/requests/models.py:978: in json\n"
                 "E   requests.exceptions.JSONDecodeError: Expecting value\n\n"
                 "/venv/lib/python3.11/site-packages/requests/models.py:978: JSONDecodeError")
    assert failure_place(traceback) == "requests/models.py:978: JSONDecodeError"
    assert failure_place("Failed: Timeout >180.0s") == ""


def test_a_model_test_failing_elsewhere_than_on_llama_server_fails_the_check(tmp_path, capsys):
    expected = tmp_path / "expected.txt"
    expected.write_text("unit/test_x.py::test_b | model: asserts the stories model's words"
                        " | llama-server: unit/test_x.py:12: AssertionError\n")
    assert report(junit(tmp_path / "same.xml", {"test_b": "12"}), expected) == 0
    assert report(junit(tmp_path / "elsewhere.xml", {"test_b": "9"}), expected) == 1
    out = capsys.readouterr().out
    assert "FAILED, not where llama-server fails it: unit/test_x.py::test_b" in out
    assert "duo: unit/test_x.py:9: AssertionError" in out and "llama-server: unit/test_x.py:12: AssertionError" in out


def test_the_refresh_lists_what_fails_on_both_at_one_place_and_leaves_duos_differences_off(tmp_path):
    expected = tmp_path / "expected.txt"
    expected.write_text("unit/test_x.py::test_feature | feature: embeddings\n"
                        "unit/test_x.py::test_owner | api: the owner's event\n"
                        "unit/test_x.py::test_model | model: asserts the stories model's words\n"
                        "unit/test_y.py::test_not_run | model: asserts the stories model's words"
                        " | llama-server: unit/test_y.py:7: AssertionError\n")
    llama = junit(tmp_path / "llama.xml", {"test_feature": "passed", "test_model": "12", "test_new_model": "20",
                                           "test_elsewhere": "30", "test_difference": "passed", "test_fixed": "5",
                                           "test_owner": "passed"})
    duo = junit(tmp_path / "duo.xml", {"test_feature": "3", "test_model": "12", "test_new_model": "20",
                                       "test_elsewhere": "31", "test_difference": "40", "test_fixed": "passed",
                                       "test_owner": "50"})
    lines, left_off = expected_lines(llama, duo, expected)
    assert lines == [
        "unit/test_x.py::test_feature | feature: embeddings",
        "unit/test_x.py::test_model | model: asserts the stories model's words"
        " | llama-server: unit/test_x.py:12: AssertionError",
        "unit/test_x.py::test_new_model | model: fails on llama-server too, at the same place, with the same stand-in"
        " models | llama-server: unit/test_x.py:20: AssertionError",
        "unit/test_x.py::test_owner | api: the owner's event",
        "unit/test_y.py::test_not_run | model: asserts the stories model's words"
        " | llama-server: unit/test_y.py:7: AssertionError",
    ]
    assert [entry.split("\n")[0] for entry in left_off] == ["unit/test_x.py::test_difference",
                                                             "unit/test_x.py::test_elsewhere"]


def test_a_run_without_the_download_serves_the_tiny_model_for_a_real_one():
    flags, _, _ = split_model_flags(["--hf-repo", "bartowski/Phi-3.5-mini-instruct-GGUF:Q4_K_M"])
    assert local_model(flags, {**ENV, "DUO_CONFORMANCE_CHAT": ""}) == ENV["DUO_CONFORMANCE_TINY"]
    assert local_model(flags, ENV) == ENV["DUO_CONFORMANCE_CHAT"]
    tiny, _, _ = split_model_flags(["--hf-repo", "ggml-org/test-model-stories260K"])
    assert local_model(tiny, {**ENV, "DUO_CONFORMANCE_CHAT": ""}) == ENV["DUO_CONFORMANCE_TINY"]


def test_ci_runs_the_conformance_check_without_a_download_after_the_projects_tests():
    ci = ROOT.joinpath(".ci", "run").read_text()
    assert "scripts/test.sh" in ci
    test_sh = ROOT.joinpath("scripts", "test.sh").read_text()
    assert "scripts/conformance.sh --no-download" in test_sh


def test_each_server_takes_its_share_of_the_cores_unless_the_suite_sets_its_threads():
    env = {**ENV, "DUO_CONFORMANCE_THREADS": "1"}
    assert with_threads(["--port", "8080"], env) == ["--port", "8080", "--threads", "1"]
    assert with_threads(["--port", "8080", "--threads", "4"], env) == ["--port", "8080", "--threads", "4"]
    assert with_threads(["--port", "8080"], ENV) == ["--port", "8080"]


def test_the_draft_pass_adds_up_the_drafts_each_request_line_of_duo_target_tells(tmp_path, capfdbinary):
    log = io.BytesIO(b"duo.target INFO request done (length): 64 tokens, accepted 11/85 drafts from draft x in 9 steps\n"
                     b"duo.target INFO request done (length): 8 tokens, no drafts verified in 8 steps\n"
                     b"duo.target INFO request done (stop): 16 tokens, accepted 4/9 drafts (4/9 from the context)\n")
    acceptance = Acceptance()
    acceptance.relay(log)
    assert capfdbinary.readouterr().err == log.getvalue(), "the server's log still reaches the suite"
    acceptance.record({"DUO_CONFORMANCE_ACCEPTANCE": str(tmp_path / "acceptance.tsv"),
                       "PYTEST_CURRENT_TEST": "unit/test_x.py::test_a (call)"})
    assert (tmp_path / "acceptance.tsv").read_text() == "unit/test_x.py::test_a\t94\t15\n"
