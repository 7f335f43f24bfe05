"""The tiny test models (tests/helpers/tiny_models.py) load in llama.cpp and behave usefully."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from helpers import tiny_models
from helpers.tiny_models import (
    DRAFT_NOISE,
    MISMATCH_TOKEN_ID,
    MISMATCH_TOKEN_TEXT,
    OVERSIZED_EXTRA_TOKENS,
    TARGET_SEED,
    write_tiny_model,
)

QWEN_VOCAB = 151936
IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643

# Token ids from the real Qwen2.5-Coder-0.5B-Instruct GGUF (llama.cpp tokenizer).
CODE = "def add(a, b):\n    return a + b"
CODE_IDS = [750, 912, 2877, 11, 293, 982, 262, 470, 264, 488, 293]
CHAT = "<|im_start|>user\nHello, wörld! 你好<|im_end|>\n"
CHAT_IDS = [151644, 872, 198, 9707, 11, 289, 9416, 507, 0, 220, 108386, 151645, 198]

PROMPTS = [
    "def add(a, b):\n    return a + b",
    "Hello, world! This is a test.",
    "The quick brown fox",
    "import numpy as np\n",
]


class Model:
    """A llama.cpp model evaluated one token at a time, with the raw logits."""

    def __init__(self, path: Path) -> None:
        self.llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=512, n_threads=1, n_threads_batch=1, logits_all=False, verbose=False
        )
        self.n_vocab = self.llm.n_vocab()

    def close(self) -> None:
        self.llm.close()

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=special)

    def _logits(self) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits(self.llm.ctx)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def run(self, prompt: Sequence[int], n: int, forced: Sequence[int] | None = None) -> tuple[list[int], np.ndarray]:
        """Greedy-generate ``n`` tokens after ``prompt`` (or feed ``forced`` instead).

        Returns the argmax at each step and the logits it came from.
        """
        self.llm.reset()
        self.llm.eval(list(prompt))
        argmaxes, logits = [], []
        for i in range(n):
            row = self._logits()
            logits.append(row)
            argmaxes.append(int(np.argmax(row)))
            self.llm.eval([argmaxes[-1] if forced is None else forced[i]])
        return argmaxes, np.array(logits)


def softmax(logits: np.ndarray) -> np.ndarray:
    p = np.exp(logits - logits.max(axis=-1, keepdims=True), dtype=np.float64)
    return p / p.sum(axis=-1, keepdims=True)


def _model_fixture(path_fixture: str):
    @pytest.fixture(scope="module")
    def fixture(request: pytest.FixtureRequest) -> Iterator[Model]:
        m = Model(request.getfixturevalue(path_fixture))
        yield m
        m.close()

    return fixture


# Loading takes ~0.5 s (mostly the 150k-token vocabulary), so load each model once.
target = _model_fixture("tiny_target")
draft = _model_fixture("tiny_draft")
mismatched = _model_fixture("tiny_mismatched")
oversized = _model_fixture("tiny_oversized")


@pytest.fixture(scope="module")
def target_runs(target: Model) -> list[tuple[list[int], list[int], np.ndarray]]:
    """(prompt ids, 64 greedy tokens, their logits) of the target for each of PROMPTS."""
    runs = []
    for text in PROMPTS:
        prompt = target.tokenize(text)
        tokens, logits = target.run(prompt, 64)
        runs.append((prompt, tokens, logits))
    return runs


def test_tokenizer_data_is_complete() -> None:
    assert tiny_models.tokenizer_field("tokenizer.ggml.model") == "gpt2"
    assert tiny_models.tokenizer_field("tokenizer.ggml.pre") == "qwen2"
    assert len(tiny_models.tokenizer_field("tokenizer.ggml.tokens")) == QWEN_VOCAB
    assert len(tiny_models.tokenizer_field("tokenizer.ggml.token_type")) == QWEN_VOCAB
    assert len(tiny_models.tokenizer_field("tokenizer.ggml.merges")) > 150_000
    assert tiny_models.tokenizer_field("tokenizer.ggml.eos_token_id") == IM_END
    assert "<|im_start|>" in tiny_models.tokenizer_field("tokenizer.chat_template")


@pytest.mark.parametrize(
    ("fixture", "n_vocab"),
    [
        ("target", QWEN_VOCAB),
        ("draft", QWEN_VOCAB),
        ("mismatched", QWEN_VOCAB),
        ("oversized", QWEN_VOCAB + OVERSIZED_EXTRA_TOKENS),
    ],
)
def test_models_load(request: pytest.FixtureRequest, fixture: str, n_vocab: int) -> None:
    m: Model = request.getfixturevalue(fixture)
    path = Path(m.llm.model_path)
    assert path.stat().st_size < 48 * 2**20
    assert m.n_vocab == n_vocab
    assert m.llm.metadata["general.architecture"] == "qwen2"
    assert m.llm.token_eos() == IM_END
    assert m.tokenize(CODE) == CODE_IDS
    tokens, _ = m.run(m.tokenize(CODE), 4)
    assert all(0 <= t < QWEN_VOCAB for t in tokens)


def test_tokenizer_matches_real_qwen(target: Model) -> None:
    assert target.tokenize(CODE) == CODE_IDS
    assert target.llm.detokenize(CODE_IDS).decode() == CODE
    assert target.tokenize(CHAT, special=True) == CHAT_IDS
    assert target.llm.detokenize(CHAT_IDS, special=True).decode() == CHAT
    assert target.llm.detokenize([IM_END], special=True) == b"<|im_end|>"


def test_mismatched_vocab_differs_at_one_token(target: Model, mismatched: Model) -> None:
    assert mismatched.llm.detokenize([MISMATCH_TOKEN_ID]).decode() == MISMATCH_TOKEN_TEXT
    assert target.llm.detokenize([MISMATCH_TOKEN_ID]).decode() != MISMATCH_TOKEN_TEXT
    others = [i for i in range(0, QWEN_VOCAB, 97) if i != MISMATCH_TOKEN_ID]
    assert mismatched.llm.detokenize(others, special=True) == target.llm.detokenize(others, special=True)


def test_mismatched_and_oversized_predict_like_draft(draft: Model, mismatched: Model, oversized: Model) -> None:
    prompt = draft.tokenize(PROMPTS[1])
    expected = draft.run(prompt, 16)[0]
    assert mismatched.run(prompt, 16)[0] == expected
    assert oversized.run(prompt, 16)[0] == expected


def test_oversized_vocab_has_extra_unused_tokens(oversized: Model) -> None:
    vocab = llama_cpp.llama_model_get_vocab(oversized.llm.model)
    for i in (QWEN_VOCAB, QWEN_VOCAB + OVERSIZED_EXTRA_TOKENS - 1):
        assert llama_cpp.llama_vocab_get_text(vocab, i) == f"[PAD{i}]".encode()


def test_greedy_is_deterministic(target: Model, tiny_target: Path, target_runs) -> None:
    prompt, tokens, _ = target_runs[0]
    assert target.run(prompt, 64)[0] == tokens
    fresh = Model(tiny_target)
    try:
        assert fresh.run(prompt, 64)[0] == tokens
    finally:
        fresh.close()


def test_generation_is_ordinary_text_that_depends_on_context(target_runs) -> None:
    hot = set(tiny_models.hot_token_ids())
    continuations = [tuple(tokens) for _, tokens, _ in target_runs]
    assert len(set(continuations)) == len(continuations)
    for tokens in continuations:
        assert set(tokens) <= hot  # words, never <|im_end|> or <|endoftext|>
        assert len(set(tokens)) >= 5


def test_distribution_is_peaked(target_runs) -> None:
    top1, top32, special = [], [], []
    for _, _, logits in target_runs:
        probs = softmax(logits)
        top1.extend(probs.max(axis=1))
        top32.extend(np.partition(probs, -32, axis=1)[:, -32:].sum(axis=1))
        special.extend(probs[:, [IM_START, IM_END, ENDOFTEXT]].max(axis=1))
    assert min(top32) > 0.8
    assert max(special) < 1e-4
    # peaked, but not one-hot: sampling explores a few tokens.
    assert 0.2 < np.median(top1) < 0.9


def test_draft_agrees_with_target_on_a_fair_share(draft: Model, target_runs) -> None:
    agree, accept = [], []
    for prompt, tokens, target_logits in target_runs:
        draft_argmax, draft_logits = draft.run(prompt, len(tokens), forced=tokens)
        agree.extend(np.array(draft_argmax) == np.array(tokens))
        # chance that speculative sampling at temperature 1 accepts the draft's token
        accept.extend(np.minimum(softmax(target_logits), softmax(draft_logits)).sum(axis=1))
        assert not np.allclose(draft_logits, target_logits)
    assert 0.3 < np.mean(agree) < 0.95, np.mean(agree)
    assert 0.4 < np.mean(accept) < 0.95, np.mean(accept)


def test_write_is_deterministic(tmp_path: Path, tiny_target: Path, tiny_draft: Path) -> None:
    again = write_tiny_model(tmp_path / "target.gguf", seed=TARGET_SEED, embedding_type="f32")
    assert again.read_bytes() == tiny_target.read_bytes()
    recipe = tiny_models.read_recipe(tiny_draft)
    assert recipe["seed"] == TARGET_SEED
    assert recipe["noise"] == [[tiny_models.DRAFT_SEED, DRAFT_NOISE]]
