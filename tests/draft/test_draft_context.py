"""duo-draft's defaults for long prompts: a session holds what its target serves (the model's whole context), without
four times the model's context of cells, and flash attention is off on a CPU."""

from __future__ import annotations

from types import SimpleNamespace

from duo.cli.draft import build_parser, session_context
from duo.cli.process import flash_attention
from duo.draft.drafter import KV_CELLS_PER_CONTEXT, SESSION_CELLS, default_cells

QWEN_CONTEXT = 32_768


def test_without_ctx_size_a_session_may_reach_the_models_training_context():
    args = build_parser().parse_args([])
    assert args.ctx_size == 0
    assert session_context(args, SimpleNamespace(n_ctx_train=QWEN_CONTEXT)) == QWEN_CONTEXT
    assert session_context(build_parser().parse_args(["--ctx-size", "2048"]),
                           SimpleNamespace(n_ctx_train=QWEN_CONTEXT)) == 2048


def test_default_cells_hold_one_session_at_its_longest_or_several_of_moderate_length():
    assert default_cells(QWEN_CONTEXT) == QWEN_CONTEXT  # one agent's 32k, or four of 8k: not 128k cells
    assert default_cells(4096) == KV_CELLS_PER_CONTEXT * 4096  # short contexts: room for four at their longest
    assert default_cells(SESSION_CELLS) == KV_CELLS_PER_CONTEXT * SESSION_CELLS


def test_the_drafts_flash_attention_is_the_model_layers_choice_unless_asked():
    assert flash_attention(build_parser().parse_args([])) is None  # off on a CPU (duo.llama.context.Context)
    assert flash_attention(build_parser().parse_args(["--flash-attn", "on"])) is True
