"""The model layer on tiny generated models: decoding, rollback, tokenizer, compatibility, devices."""

from __future__ import annotations

import numpy as np
import pytest

from duo.llama.backends import available_backends, gpu_layers_for
from duo.llama.model import Model, ModelError
from duo.llama.vocab import IncompatibleVocab, Vocab, check_compatible


def test_decode_returns_the_logits_of_every_position_that_asked(target_model):
    context = target_model.new_context(256)
    tokens = target_model.tokenize("def add(a, b):\n    return a + b")
    logits = context.decode(tokens, 0, logits_for=[0, 3, len(tokens) - 1])
    assert logits.shape == (3, target_model.n_vocab) and logits.dtype == np.float32
    assert context.n_past == len(tokens)
    context.close()


def test_decoding_after_a_rollback_gives_the_logits_of_a_fresh_decode(target_model):
    prefix = target_model.tokenize("The quick brown fox")
    right = target_model.tokenize(" jumps over")
    wrong = target_model.tokenize(" sleeps under the")
    fresh = target_model.new_context(256)
    fresh.decode(prefix, 0, logits_for=[])
    expected = fresh.decode(right, len(prefix), logits_for=range(len(right)))

    rolled = target_model.new_context(256)
    rolled.decode(prefix, 0, logits_for=[])
    rolled.decode(wrong, len(prefix), logits_for=range(len(wrong)))
    rolled.rollback(len(prefix))
    assert rolled.n_past == len(prefix)
    again = rolled.decode(right, len(prefix), logits_for=range(len(right)))
    np.testing.assert_allclose(again, expected, rtol=0, atol=1e-4)
    fresh.close()
    rolled.close()


def test_decode_refuses_a_position_that_does_not_follow_the_cache(target_model):
    context = target_model.new_context(64)
    context.decode([1, 2, 3], 0)
    with pytest.raises(ModelError, match="KV cache holds 3"):
        context.decode([4], 5)
    context.close()


def test_decode_refuses_to_overflow_the_context(target_model):
    context = target_model.new_context(16)
    with pytest.raises(ModelError, match="context full"):
        context.decode(list(range(100, 120)), 0)
    context.close()


def test_long_prompts_are_decoded_in_chunks_of_the_batch_size(target_model):
    tokens = target_model.tokenize("word " * 200)
    whole = target_model.new_context(512, n_batch=512)
    chunked = target_model.new_context(512, n_batch=64)
    expected = whole.decode(tokens, 0)
    got = chunked.decode(tokens, 0)
    # Different batch splits sum in a different order: equal up to float rounding.
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)
    assert chunked.n_past == whole.n_past == len(tokens)
    whole.close()
    chunked.close()


def test_tokenizer_round_trips_text_and_special_tokens(target_model):
    text = "<|im_start|>user\nwrite snake in python<|im_end|>"
    tokens = target_model.tokenize(text)
    assert tokens[0] == 151644  # <|im_start|> parsed as one special token
    assert target_model.detokenize(tokens, special=True).decode() == text
    assert target_model.detokenize(tokens).decode() == "user\nwrite snake in python"


def test_chat_prompt_uses_the_models_template(target_model):
    prompt = target_model.chat_prompt([{"role": "user", "content": "hi"}])
    assert "<|im_start|>user\nhi<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_end_of_generation_tokens_are_known(target_model):
    assert target_model.is_end_of_generation(target_model.vocab().eos)
    assert not target_model.is_end_of_generation(target_model.tokenize("hello")[0])


def test_the_tiny_pair_is_compatible_and_shares_a_vocabulary(target_model, draft_model):
    check_compatible(target_model.vocab(), draft_model.vocab())
    assert target_model.vocab() == draft_model.vocab()
    assert target_model.vocab().n_vocab == 151936


def test_a_different_token_text_is_refused_naming_the_first_differing_token(target_model, tiny_mismatched):
    mismatched = Model(tiny_mismatched, device="cpu", threads=1)
    with pytest.raises(IncompatibleVocab, match="token 1000 differs"):
        check_compatible(target_model.vocab(), mismatched.vocab())
    assert target_model.vocab() != mismatched.vocab()
    mismatched.close()


def test_a_vocabulary_much_larger_is_refused(target_model, tiny_oversized):
    oversized = Model(tiny_oversized, device="cpu", threads=1)
    with pytest.raises(IncompatibleVocab, match="sizes differ by 200"):
        check_compatible(target_model.vocab(), oversized.vocab())
    oversized.close()


def small_vocab(texts: list[bytes], **changes) -> Vocab:
    fields = dict(vocab_type=2, bos=1, eos=2, add_bos=False, add_eos=False, token_texts=tuple(texts))
    fields.update(changes)
    return Vocab(**fields)


def test_compatibility_follows_llama_cpp_rules():
    texts = [f"t{i}".encode() for i in range(300)]
    base = small_vocab(texts)
    # The first 5 ids may differ; up to 128 extra tokens are fine.
    check_compatible(base, small_vocab([b"x"] * 5 + texts[5:]))
    check_compatible(base, small_vocab(texts + [b"extra"] * 128))
    with pytest.raises(IncompatibleVocab, match="types differ"):
        check_compatible(base, small_vocab(texts, vocab_type=1))
    with pytest.raises(IncompatibleVocab, match="BOS"):
        check_compatible(small_vocab(texts, add_bos=True), small_vocab(texts, add_bos=True, bos=7))
    with pytest.raises(IncompatibleVocab, match="EOS"):
        check_compatible(base, small_vocab(texts, add_eos=True))
    with pytest.raises(IncompatibleVocab, match="token 5 differs"):
        check_compatible(base, small_vocab(texts[:5] + [b"other"] + texts[6:]))
    # A peer's token text of any size is clipped in the message (it reaches logs and /health).
    with pytest.raises(IncompatibleVocab, match=r"token 6 differs.*\.\.\. \(1000000 bytes\)") as refused:
        check_compatible(base, small_vocab(texts[:6] + [b"y" * 1_000_000] + texts[7:]))
    assert len(str(refused.value)) < 300


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        Model(tmp_path / "nope.gguf")


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelError, match="cannot load"):
        Model(bad)


def test_asking_for_a_gpu_this_build_lacks_is_an_error_not_a_cpu_fallback():
    missing = [d for d, names in (("cuda", "CUDA"), ("metal", "Metal"), ("vulkan", "Vulkan"))
               if not any(b.startswith(names) for b in available_backends())]
    if not missing:
        pytest.skip("this build has every GPU backend")
    with pytest.raises(ModelError, match=f"no {missing[0]} backend.*CMAKE_ARGS"):
        gpu_layers_for(missing[0], None)
    assert gpu_layers_for("cpu", None) == 0
    with pytest.raises(ModelError, match="unknown device"):
        gpu_layers_for("tpu", None)


def test_a_forked_sequence_continues_the_main_prefix_as_if_decoded_afresh(target_model):
    tokens = target_model.tokenize("def add(a, b):\n    return a + b\n")
    prefix, branch = tokens[:6], tokens[6:9]
    context = target_model.new_context(128, n_seq=2)
    main_last = context.decode(tokens, 0)  # the main sequence runs past the fork
    context.fork(1, len(prefix))
    forked = context.decode(branch, len(prefix), logits_for=range(len(branch)), seq=1)
    fresh = target_model.new_context(128)
    fresh.decode(prefix, 0)
    np.testing.assert_allclose(forked, fresh.decode(branch, len(prefix), logits_for=range(len(branch))), atol=1e-3)
    # The main sequence is untouched by the branch beside it.
    assert context.n_past == len(tokens)
    context.rollback(len(tokens) - 1)
    np.testing.assert_allclose(context.decode(tokens[-1:], len(tokens) - 1), main_last, atol=1e-3)
    context.close()
    fresh.close()


def test_a_sequence_adopts_the_longest_prefix_any_sequence_holds_and_continues_it_as_if_decoded_afresh(target_model):
    system = target_model.tokenize("<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\n")
    first, other, second = (target_model.tokenize(text, add_special=False)
                            for text in ("sort a list", "unrelated words here", "reverse a string"))
    context = target_model.new_context(128, n_seq=3, cells=3 * 128)
    context.decode(system + first, 0, seq=0)
    context.decode(other, 0, seq=1)
    assert context.adopt_prefix(2, system + second) == len(system)  # from sequence 0: the system turn
    assert list(context.held(2)) == system
    # The source may go on, even roll back below the shared prefix: the adopted cells stay sequence 2's.
    context.rollback(3, seq=0)
    adopted = context.decode(second, len(system), logits_for=range(len(second)), seq=2)
    fresh = target_model.new_context(128)
    fresh.decode(system, 0)
    np.testing.assert_allclose(adopted, fresh.decode(second, len(system), logits_for=range(len(second))), atol=1e-3)
    # A sequence that holds more of the prompt than any other keeps it, and drops what differs.
    assert context.adopt_prefix(2, system + second[:2] + other) == len(system) + 2
    assert list(context.held(2)) == system + second[:2]
    assert context.adopt_prefix(1, [7, 8, 9]) == 0 and context.past(1) == 0
    context.close()
    fresh.close()
