"""duo-target's long-prompt defaults: the model's whole context (llama-server's -c 0), flash attention off on a CPU."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from duo.cli.process import flash_attention
from duo.cli.target import build_parser, check_client_flags, request_context
from duo.llama.model import Model
from duo.llama.worker import ModelWorker
from duo.target.request import SpecSettings
from duo.target.target import Target

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


def test_flash_attention_is_the_model_layers_choice_unless_asked():
    assert flash_attention(build_parser().parse_args([])) is None
    assert flash_attention(build_parser().parse_args(["--flash-attn", "on"])) is True
    assert flash_attention(build_parser().parse_args(["--flash-attn", "off"])) is False


def test_the_targets_context_on_the_cpu_runs_without_flash_attention_by_default(tiny_target):
    """On a CPU llama.cpp's flash attention reads the whole cache once per query row and runs slower than the plain
    attention, the more so the longer the context and the verify step (scripts/measure_context.py)."""
    model = Model(tiny_target, threads=1)
    target = Target(model, ModelWorker(), n_ctx=256, settings=SpecSettings())
    try:
        assert asyncio.run(target.batcher()).context.flash_attn is False
        asyncio.run(target.close())
        asked = Target(model, ModelWorker(), n_ctx=256, settings=SpecSettings(), flash_attn=True)
        assert asyncio.run(asked.batcher()).context.flash_attn is True
        asyncio.run(asked.close())
    finally:
        model.close()
