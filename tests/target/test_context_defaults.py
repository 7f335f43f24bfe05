"""duo-target's context per request by default: the model's, as llama-server's (-c 0), so that agents' prompts fit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from duo.cli.target import build_parser, check_client_flags, request_context

QWEN_CONTEXT = 32_768  # Qwen2.5-Coder's training context, what llama-server serves by default


def test_without_ctx_size_a_request_may_reach_the_models_training_context():
    args = build_parser().parse_args([])
    assert args.ctx_size == 0
    assert request_context(args, SimpleNamespace(n_ctx_train=QWEN_CONTEXT)) == QWEN_CONTEXT


def test_a_ctx_size_given_is_kept_within_the_models_context():
    model = SimpleNamespace(n_ctx_train=QWEN_CONTEXT)
    assert request_context(build_parser().parse_args(["--ctx-size", "4096"]), model) == 4096
    assert request_context(build_parser().parse_args(["--ctx-size", "65536"]), model) == QWEN_CONTEXT


def test_a_negative_ctx_size_is_refused_naming_the_flag():
    args = build_parser().parse_args(["--ctx-size", "-1", "--listen", "127.0.0.1:0"])
    with pytest.raises(ValueError, match="--ctx-size"):
        check_client_flags(args)
