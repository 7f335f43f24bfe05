"""duo-target takes llama-server's launch line: each of its flags parsed to the setting it means, its sampling flags
as server-wide defaults, and the flags duo does not implement ignored (changing no answer) or refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from duo.api.serving.defaults import LLAMA_SERVER_SAMPLING
from duo.cli.llama_flags import LLAMA_FLAGS, IGNORED, REFUSED, ignored_lines, refusal
from duo.cli.llama_launch import (chat_template, context_per_request, cors_origins, http_addresses, launch_settings,
                                  served_names, server_defaults)
from duo.llama.templates import BUILTIN_SOURCES
from duo.cli.target import build_parser, check_client_flags, main
from helpers.flags import target_flags


def test_llama_servers_model_and_process_flags_set_duos_settings():
    args = target_flags("-m model.gguf -c 256 -np 2 -t 3 -ngl all -fa on -ts 3,1 "
                        "--ssl-cert-file c.pem --ssl-key-file k.pem")
    assert (args.model, args.ctx_size, args.parallel, args.threads) == ("model.gguf", 256, 2, 3)
    assert args.gpu_layers is None and args.flash_attn == "on" and args.tensor_split == "3,1"
    assert (args.tls_cert, args.tls_key) == ("c.pem", "k.pem")
    assert target_flags("--n-gpu-layers 12").gpu_layers == 12


def test_cache_ram_is_the_host_memory_for_idle_prefixes_and_no_cache_idle_slots_keeps_them_in_the_cache():
    assert target_flags("").cache_ram == 8192  # llama-server's default
    assert target_flags("-cram 100").cache_ram == 100 and target_flags("--cache-ram -1").cache_ram == -1
    assert target_flags("--no-cache-idle-slots").cache_ram == 0
    assert target_flags("--cache-idle-slots").cache_ram == 8192 and target_flags("--cache-idle-slots").ignored_flags


def test_aliases_are_comma_separated_and_the_first_sorted_one_is_the_models_id(tmp_path: Path):
    args = target_flags("-a zeta,alpha --alias beta -a alpha --tags small,chat")
    names = served_names(tmp_path / "tiny-target.gguf", "tiny-target.gguf", args.alias)
    assert names == ["alpha", "beta", "zeta"]  # llama-server keeps them in a std::set: sorted, once each
    settings = launch_settings(args)
    assert settings.aliases == ("alpha", "beta", "zeta") and settings.tags == ("chat", "small")
    assert served_names(tmp_path / "tiny-target.gguf", "tiny-target.gguf", target_flags("").alias) == ["tiny-target"]


def test_sampling_flags_are_server_defaults_under_the_fields_a_request_sends():
    args = target_flags("--temp 0.8 --top-k 40 --top-p 0.9 --min-p 0.1 --seed 42 -n 64 --repeat-penalty 1.1 "
                 "--presence-penalty 0.5 --typical 0.95 --mirostat-ent 4 --samplers top_k;temperature --ignore-eos "
                 "--reasoning-format none")
    assert dict(server_defaults(args).fields) == {
        "temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.1, "seed": 42, "n_predict": 64,
        "repeat_penalty": 1.1, "presence_penalty": 0.5, "typical_p": 0.95, "mirostat_tau": 4.0,
        "samplers": ["top_k", "temperature"], "ignore_eos": True, "reasoning_format": "none"}
    assert dict(server_defaults(target_flags("--temperature 0.5 --predict 8")).fields) == {
        **LLAMA_SERVER_SAMPLING, "temperature": 0.5, "n_predict": 8}  # llama-server's own under the line's


def test_with_no_sampling_flag_the_defaults_are_llama_servers_own():
    assert dict(server_defaults(target_flags("")).fields) == LLAMA_SERVER_SAMPLING


def test_seed_minus_one_leaves_each_request_its_random_seed_as_llama_server():
    assert "seed" not in server_defaults(target_flags("-s -1")).fields


def test_a_default_a_request_could_not_send_stops_startup_naming_the_flag():
    with pytest.raises(ValueError, match="--typical-p 2.0"):
        server_defaults(target_flags("--typical 2"))


def test_host_and_port_are_the_http_address_in_llama_servers_forms():
    assert http_addresses(target_flags("--port 9000")) == ["127.0.0.1:9000"]
    assert http_addresses(target_flags("--host 0.0.0.0")) == ["0.0.0.0:8080"]
    assert http_addresses(target_flags("--host 127.0.0.1,::1 --port 9000")) == ["127.0.0.1:9000", "[::1]:9000"]
    assert http_addresses(target_flags("--http 127.0.0.1:9001")) == ["127.0.0.1:9001"]
    assert http_addresses(target_flags("")) == []
    with pytest.raises(ValueError, match="UNIX sockets"):
        http_addresses(target_flags("--host /tmp/llama.sock"))
    with pytest.raises(ValueError, match="not both"):
        http_addresses(target_flags("--http 9001 --port 9000"))


def test_cors_origins_is_a_comma_separated_list_and_star_is_any_origin():
    assert cors_origins(target_flags("--cors-origins http://a.example,http://b.example")) == ["http://a.example",
                                                                                     "http://b.example"]
    assert cors_origins(target_flags("--cors-origins *")) is None


def test_ctx_size_is_per_request_and_the_total_of_np_requests_with_no_kv_unified():
    assert target_flags("").kv_unified
    assert not target_flags("--no-kv-unified").kv_unified and not target_flags("-no-kvu").kv_unified
    assert context_per_request(256, 4096, 2, kv_unified=True) == 256  # duo's documented --ctx-size
    assert context_per_request(256, 4096, 2, kv_unified=False) == 128  # llama-server's -c 256 -np 2
    assert context_per_request(0, 4096, 4, kv_unified=False) == 1024  # -c 0: the training context, shared


def test_slots_and_metrics_switches_read_as_llama_server_writes_them():
    assert target_flags("").slots and not target_flags("--no-slots").slots and target_flags("--no-slots --slots").slots
    assert target_flags("").metrics is None and target_flags("--metrics").metrics == ""
    assert target_flags("--metrics 9100").metrics == "9100"


def test_chat_template_takes_jinja_a_file_or_a_built_in_name_and_names_what_duo_cannot_render(tmp_path: Path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert chat_template(target_flags(f"--chat-template-file {template}")) == template.read_text()
    assert chat_template(target_flags("--chat-template chatml")) == BUILTIN_SOURCES["chatml"]
    assert chat_template(target_flags("")) is None
    with pytest.raises(ValueError, match="cannot read"):
        chat_template(target_flags(f"--chat-template-file {tmp_path / 'missing.jinja'}"))
    template.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="not a Jinja template"):
        chat_template(target_flags(f"--chat-template-file {template}"))


def test_flags_that_change_no_answer_are_accepted_with_a_line_saying_duo_ignores_them():
    args = target_flags("-ub 512 --mlock -cb --threads-batch 4")
    assert refusal(args) is None
    assert ignored_lines(args) == [f"duo-target ignores llama-server's {flag}: {why}" for flag, why in (
        ("-ub", "performance only"), ("--mlock", "performance only"), ("-cb", "performance only"),
        ("--threads-batch", "performance only"))]


@pytest.mark.parametrize("line, flag", [("--lora adapter.gguf", "--lora"), ("--embeddings", "--embeddings"),
                                        ("-ctk q8_0", "-ctk"), ("--lora-scaled a.gguf 0.5", "--lora-scaled"),
                                        ("--no-jinja", "--no-jinja"), ("-md draft.gguf", "-md")])
def test_flags_whose_absence_would_change_answers_stop_startup_naming_them(line, flag, capsys):
    assert main(line.split()) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"duo-target: {flag}: ") and "refused" in error


def test_check_client_flags_refuses_a_bad_launch_line_before_anything_starts():
    with pytest.raises(ValueError, match="--rope-freq-base"):
        check_client_flags(target_flags("--rope-freq-base 10000"))


def test_help_prints_the_table_of_llama_servers_flags():
    text = build_parser().format_help()
    for flag in LLAMA_FLAGS:
        assert ", ".join(flag.names) in text
    assert "refused at startup" in text and "accepted and ignored" in text and "sampling defaults" in text
    assert {flag.kind for flag in LLAMA_FLAGS} >= {IGNORED, REFUSED}


@pytest.mark.parametrize("line", ["--draft-ma 4", "--reasoning-budg 0", "--spec-draft-n 4"])
def test_a_flag_is_never_taken_by_a_prefix_of_another(line, capsys):
    """argparse takes an unambiguous prefix as the flag it begins: a llama-server flag duo lacks must be refused by
    name, never read as another flag it begins (--reasoning-budget), and a duo flag is spelled whole."""
    with pytest.raises(SystemExit):
        target_flags(line)
    assert line.split()[0] in capsys.readouterr().err
