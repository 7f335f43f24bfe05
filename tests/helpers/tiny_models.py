"""Tiny random-weight GGUF models with a real tokenizer, for tests.

The models use llama.cpp's ``qwen2`` architecture and carry the complete
tokenizer of Qwen2.5-Coder (``tests/data/qwen2-tokenizer.json.gz``, made by
``scripts/extract_tokenizer.py``), so text tokenizes exactly as with the real
model, but the weights are random and tiny (2 layers of width 64: a 17 MB file,
mostly vocabulary, written in well under a second and decoding about a thousand
tokens/s on one CPU thread).  Nothing is downloaded.

The weights are not plain noise; they are built so that the models behave a
little like language models (see ``_make_weights``):

* almost all probability mass at temperature 1 goes to a fixed set of
  ``len(HOT_WORDS)`` ordinary English word tokens (" the", " of", ...), so
  sampled or greedy text is made of words and practically never hits a special
  token such as ``<|im_end|>`` or ``<|endoftext|>``;
* within that set the distribution is peaked but depends on the context
  (tokens and positions), so different prompts give different continuations.

A "draft" model is the same weights plus Gaussian noise (``noise`` is relative
to each weight row's RMS).  With ``noise=DRAFT_NOISE`` the draft's greedy choice
agrees with the target's on about 60% of the positions of a greedy generation
(teacher-forced), and sum(min(p_target, p_draft)), the chance that speculative
sampling at temperature 1 accepts a draft token, is about 0.75: speculative
decoding accepts some draft tokens and rejects others.

Every model records its recipe (seed, shape, noise steps, tokenizer changes)
in the GGUF key ``duo.tiny_model.recipe``; ``base=`` reads it back from the
start of the file and regenerates the weights, so no weights are parsed.
"""

from __future__ import annotations

import functools
import gzip
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import gguf
import numpy as np

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
TOKENIZER_FILE = DATA_DIR / "qwen2-tokenizer.json.gz"

ARCH = "qwen2"
RECIPE_KEY = "duo.tiny_model.recipe"

#: Relative noise scale of the draft made by :func:`write_tiny_pair`.  Greedy
#: agreement with the target falls from ~0.73 at 0.03 to ~0.56 at 0.05.
DRAFT_NOISE = 0.04
TARGET_SEED = 1234
DRAFT_SEED = 5678

#: Token id whose text the ``tiny_mismatched`` fixture changes, and its new text.
MISMATCH_TOKEN_ID = 1000
MISMATCH_TOKEN_TEXT = "<duo-edited-1000>"
#: How many tokens the ``tiny_oversized`` fixture appends to the vocabulary.
OVERSIZED_EXTRA_TOKENS = 200

#: The tokens that get almost all probability mass (each is "Ġ" + word, one token).
HOT_WORDS: tuple[str, ...] = tuple(
    "the of and to in is that for it as with was on be at by this had not are but "
    "from or have an they which one you were her all she there would their we him "
    "been has when who will more no if out so".split()
)

# Shape of the weights (see _make_weights).  Channel 0 of the residual stream is
# the "hot" channel: every token embedding has KAPPA there, hot tokens KAPPA +
# ALPHA, and no layer reads or writes it, so the output logit of a hot token is
# raised by OUT_HOT_GAIN * ALPHA * (normalised channel 0) relative to the rest.
_KAPPA = 2.0
_ALPHA = 1.0
_OUT_HOT_GAIN = 6.0
_COLD_NORM = 1.0  # norm of an ordinary token embedding (channels 1..)
_HOT_NORM = 3.0  # norm of a hot token embedding (channels 1..)
_QK_GAIN = 1.5  # attention sharpness
_ATTN_OUT_GAIN = 1.0
_FFN_OUT_GAIN = 1.0


# ----------------------------------------------------------------------------
# tokenizer


@functools.lru_cache(maxsize=1)
def _tokenizer_fields() -> tuple[dict[str, Any], ...]:
    with gzip.open(TOKENIZER_FILE, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return tuple(data["fields"])


def tokenizer_field(key: str) -> Any:
    """Value of a ``tokenizer.*`` key of the stored tokenizer (do not mutate)."""
    for field in _tokenizer_fields():
        if field["key"] == key:
            return field["value"]
    raise KeyError(key)


@functools.lru_cache(maxsize=1)
def _base_vocab() -> tuple[list[str], dict[str, int]]:
    tokens = tokenizer_field("tokenizer.ggml.tokens")
    return tokens, {t: i for i, t in enumerate(tokens)}


def base_vocab_size() -> int:
    """Number of tokens in the stored tokenizer (151936 for Qwen2.5)."""
    return len(_base_vocab()[0])


def hot_token_ids() -> list[int]:
    """Ids of the tokens that the tiny models prefer (``" " + w`` for ``HOT_WORDS``)."""
    _, index = _base_vocab()
    return [index["\u0120" + w] for w in HOT_WORDS]


class _Packed(list):
    """An array value whose GGUF encoding is computed once and cached."""

    def __init__(self, items: Any, sub_type: gguf.GGUFValueType) -> None:
        super().__init__(items)
        self.sub_type = sub_type
        self.packed: bytes | None = None

    def pack(self) -> bytes:
        if self.packed is None:
            if self.sub_type == gguf.GGUFValueType.STRING:
                parts = []
                for s in self:
                    b = s.encode("utf-8")
                    parts.append(struct.pack("<Q", len(b)))
                    parts.append(b)
                body = b"".join(parts)
            else:
                fmt = "<" + gguf.GGUFWriter._simple_value_packing[self.sub_type]
                body = np.asarray(self, dtype=np.dtype(fmt)).tobytes()
            self.packed = struct.pack("<IQ", self.sub_type, len(self)) + body
        return self.packed


class _FastWriter(gguf.GGUFWriter):
    # GGUFWriter packs array items one by one in Python, which costs about half
    # a second for the tokenizer arrays; pack them once per session instead.
    def _pack_val(self, val, vtype, add_vtype, sub_type=None):  # type: ignore[override]
        if isinstance(val, _Packed) and vtype == gguf.GGUFValueType.ARRAY:
            assert self.endianess == gguf.GGUFEndian.LITTLE
            return (self._pack("I", vtype) if add_vtype else b"") + val.pack()
        return super()._pack_val(val, vtype, add_vtype, sub_type)


@functools.lru_cache(maxsize=1)
def _packed_merges() -> _Packed:
    return _Packed(tokenizer_field("tokenizer.ggml.merges"), gguf.GGUFValueType.STRING)


@functools.lru_cache(maxsize=4)
def _packed_tokens(edits: tuple[tuple[int, str], ...], extra: int) -> tuple[_Packed, _Packed]:
    tokens, index = _base_vocab()
    types = list(tokenizer_field("tokenizer.ggml.token_type"))
    out = _Packed(tokens, gguf.GGUFValueType.STRING)
    for tid, text in edits:
        if not 0 <= tid < len(tokens):
            raise ValueError(f"tokenizer_edits: id {tid} is out of range")
        if text in index and index[text] != tid:
            raise ValueError(f"tokenizer_edits: {text!r} is already token {index[text]}")
        out[tid] = text
    n = len(tokens)
    out.extend(f"[PAD{i}]" for i in range(n, n + extra))
    types.extend([int(gguf.TokenType.UNUSED)] * extra)
    return out, _Packed(types, gguf.GGUFValueType.INT32)


def _add_tokenizer(writer: gguf.GGUFWriter, edits: dict[int, str], extra: int, chat_template: str | None) -> None:
    tokens, types = _packed_tokens(tuple(sorted(edits.items())), extra)
    for field in _tokenizer_fields():
        key = field["key"]
        vtype = gguf.GGUFValueType[field["type"]]
        sub_type = gguf.GGUFValueType[field["sub_type"]] if "sub_type" in field else None
        value = field["value"]
        if key == "tokenizer.ggml.tokens":
            value = tokens
        elif key == "tokenizer.ggml.token_type":
            value = types
        elif key == "tokenizer.ggml.merges":
            value = _packed_merges()
        elif key == "tokenizer.chat_template" and chat_template is not None:
            value = chat_template
        writer.add_key_value(key, value, vtype, sub_type)


# ----------------------------------------------------------------------------
# weights


def _rng(seed: int, name: str, step: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), step])


def _normal(seed: int, name: str, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    x = _rng(seed, name).standard_normal(shape, dtype=np.float32)
    if scale != 1.0:
        x *= np.float32(scale)
    return x


def _make_weights(r: dict[str, Any]) -> dict[str, np.ndarray]:
    """Deterministic weights (numpy layout: ``W[out, in]``) for a recipe."""
    seed = r["seed"]
    n_layer, d, n_head, n_head_kv, n_ff = (r[k] for k in ("n_layer", "n_embd", "n_head", "n_head_kv", "n_ff"))
    n_vocab = base_vocab_size() + r["extra_tokens"]
    head_dim = d // n_head
    d_kv = head_dim * n_head_kv
    hot = np.array(hot_token_ids())

    # The output norm flips the sign of half of the content channels 1..d-1;
    # with each hot embedding's energy split evenly between the two halves, a
    # token's own embedding adds nothing to its logit (with the tied output it
    # would otherwise dominate it), so the models do not just repeat the input.
    signs = np.ones(d, dtype=np.float32)
    perm = _rng(seed, "signs").permutation(np.arange(1, d))
    neg = perm[: (d - 1) // 2]
    signs[neg] = -1.0

    w: dict[str, np.ndarray] = {}
    emb = _normal(seed, "token_embd", (n_vocab, d), _COLD_NORM / np.sqrt(d - 1))
    emb[:, 0] = _KAPPA
    h = _normal(seed, "token_embd.hot", (len(hot), d - 1))
    pos = signs[1:] > 0
    h[:, pos] *= (_HOT_NORM / np.sqrt(2)) / np.linalg.norm(h[:, pos], axis=1, keepdims=True)
    h[:, ~pos] *= (_HOT_NORM / np.sqrt(2)) / np.linalg.norm(h[:, ~pos], axis=1, keepdims=True)
    emb[hot, 1:] = h
    emb[hot, 0] = _KAPPA + _ALPHA
    w["token_embd.weight"] = emb

    out_norm = signs.copy()
    out_norm[0] = _OUT_HOT_GAIN
    w["output_norm.weight"] = out_norm

    def mat(name: str, n_out: int, n_in: int, gain: float) -> np.ndarray:
        return _normal(seed, name, (n_out, n_in), gain / np.sqrt(n_in))

    for i in range(n_layer):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = np.ones(d, dtype=np.float32)
        w[p + "attn_q.weight"] = mat(p + "attn_q.weight", d, d, _QK_GAIN)
        w[p + "attn_q.bias"] = _normal(seed, p + "attn_q.bias", (d,), 0.1)
        w[p + "attn_k.weight"] = mat(p + "attn_k.weight", d_kv, d, _QK_GAIN)
        w[p + "attn_k.bias"] = _normal(seed, p + "attn_k.bias", (d_kv,), 0.1)
        w[p + "attn_v.weight"] = mat(p + "attn_v.weight", d_kv, d, 1.0)
        w[p + "attn_v.bias"] = _normal(seed, p + "attn_v.bias", (d_kv,), 0.1)
        w[p + "attn_output.weight"] = mat(p + "attn_output.weight", d, d, _ATTN_OUT_GAIN)
        w[p + "ffn_norm.weight"] = np.ones(d, dtype=np.float32)
        w[p + "ffn_gate.weight"] = mat(p + "ffn_gate.weight", n_ff, d, 1.0)
        w[p + "ffn_up.weight"] = mat(p + "ffn_up.weight", n_ff, d, 1.0)
        w[p + "ffn_down.weight"] = mat(p + "ffn_down.weight", d, n_ff, _FFN_OUT_GAIN)
        # Layers neither read nor write the hot channel.
        for k in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"):
            w[p + k + ".weight"][:, 0] = 0.0
        for k in ("attn_output", "ffn_down"):
            w[p + k + ".weight"][0, :] = 0.0
    return w


def _add_noise(w: dict[str, np.ndarray], seed: int, noise: float, step: int) -> None:
    """Add Gaussian noise of ``noise`` times each row's RMS (each tensor's for 1-D)."""
    if noise == 0:
        return
    for name, x in w.items():
        scale = np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True), dtype=np.float32)
        eps = _rng(seed, name, step).standard_normal(x.shape, dtype=np.float32)
        eps *= scale * np.float32(noise)
        x += eps


# ----------------------------------------------------------------------------
# recipe header


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The recipe a tiny model was written with (parses only the file's start)."""
    with open(path, "rb") as f:
        magic, _version, _n_tensors, n_kv = struct.unpack("<IIQQ", f.read(24))
        if magic != gguf.GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file")

        def read_str() -> str:
            (n,) = struct.unpack("<Q", f.read(8))
            return f.read(n).decode("utf-8")

        for _ in range(n_kv):
            key = read_str()
            (vtype,) = struct.unpack("<I", f.read(4))
            if key == RECIPE_KEY and vtype == gguf.GGUFValueType.STRING:
                return json.loads(read_str())
            if vtype == gguf.GGUFValueType.STRING:
                read_str()
            elif vtype == gguf.GGUFValueType.ARRAY:
                break  # the recipe is written before any array
            else:
                f.read(struct.calcsize(gguf.GGUFWriter._simple_value_packing[gguf.GGUFValueType(vtype)]))
    raise ValueError(f"{path}: not a tiny test model (no {RECIPE_KEY})")


# ----------------------------------------------------------------------------
# public API


def write_tiny_model(
    path: str | Path,
    *,
    seed: int,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx: int = 2048,
    base: Path | None = None,
    noise: float = 0.0,
    tokenizer_edits: dict[int, str] | None = None,
    extra_tokens: int = 0,
    embedding_type: str = "q8_0",
    chat_template: str | None = None,
) -> Path:
    """Write a tiny ``qwen2`` GGUF model with the real Qwen2.5 tokenizer to ``path``.

    Without ``base`` the weights are a deterministic function of ``seed`` and
    the shape arguments; ``noise > 0`` then adds Gaussian noise (relative to
    each weight row's RMS) drawn from a second generator seeded by ``seed``, so
    ``write_tiny_model(p, seed=s, noise=x)`` is a perturbed copy of the model
    ``write_tiny_model(p, seed=s)``.

    With ``base`` (a model written by this function) the weights are those of
    ``base`` plus noise of scale ``noise`` drawn with ``seed``; the shape
    arguments are taken from ``base`` and the ones given here are ignored, and
    ``tokenizer_edits``/``extra_tokens`` are added to those of ``base``.

    ``tokenizer_edits`` replaces the text of the given token ids (the new text
    must not already be a token); ``extra_tokens`` appends that many unused
    ``[PADn]`` tokens (with embedding rows) after the real vocabulary.  The
    weights of the existing tokens are unaffected by both. ``chat_template`` replaces Qwen2.5's (another model
    family's template over the same vocabulary and weights).

    The token embedding (tied with the output) is Q8_0 or, with ``embedding_type="f32"``,
    F32; the rest is F32. The output matmul over the 151936-token vocabulary is most of a
    tiny model's work, so an F32 embedding makes a model several times slower to decode,
    memory-bound like a real large target: that is how the test target stays slower than its
    draft, as in real use.
    """
    if embedding_type not in ("q8_0", "f32"):
        raise ValueError(f"embedding_type must be 'q8_0' or 'f32', got {embedding_type!r}")
    path = Path(path)
    if base is not None:
        recipe = read_recipe(base)
        recipe["noise"] = list(recipe["noise"])
        recipe["tokenizer_edits"] = dict(recipe["tokenizer_edits"])
    else:
        if n_embd % n_head or n_head % n_head_kv or (n_embd // n_head) % 2:
            raise ValueError("n_embd must split into n_head heads of even size; n_head into n_head_kv groups")
        recipe = {
            "seed": seed, "n_layer": n_layer, "n_embd": n_embd, "n_head": n_head,
            "n_head_kv": n_head_kv, "n_ff": n_ff, "n_ctx": n_ctx,
            "noise": [], "tokenizer_edits": {}, "extra_tokens": 0,
        }  # fmt: skip
    if noise:
        recipe["noise"].append([seed, float(noise)])
    recipe["tokenizer_edits"].update({str(int(k)): v for k, v in (tokenizer_edits or {}).items()})
    recipe["extra_tokens"] += int(extra_tokens)

    weights = _make_weights(recipe)
    for step, (noise_seed, scale) in enumerate(recipe["noise"], start=1):
        _add_noise(weights, noise_seed, scale, step)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    writer = _FastWriter(tmp, ARCH)
    writer.add_string(RECIPE_KEY, json.dumps(recipe, sort_keys=True))
    writer.add_type("model")
    writer.add_name(f"duo tiny test model (seed {recipe['seed']}, noise {recipe['noise']})")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if embedding_type == "q8_0" else gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(recipe["n_ctx"])
    writer.add_embedding_length(recipe["n_embd"])
    writer.add_block_count(recipe["n_layer"])
    writer.add_feed_forward_length(recipe["n_ff"])
    writer.add_head_count(recipe["n_head"])
    writer.add_head_count_kv(recipe["n_head_kv"])
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    _add_tokenizer(writer, {int(k): v for k, v in recipe["tokenizer_edits"].items()}, recipe["extra_tokens"],
                   chat_template)
    for name, x in weights.items():
        if name == "token_embd.weight" and embedding_type == "q8_0":
            # Q8_0 rather than F16: a smaller file and a faster output matmul.
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(x, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, x)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path


def write_tiny_pair(dir: Path) -> tuple[Path, Path]:
    """Write a (target, draft) pair into ``dir``: the draft is the target plus ``DRAFT_NOISE``,
    stored with a Q8_0 embedding so that it decodes about twice as fast as the F32 target."""
    dir = Path(dir)
    target = write_tiny_model(dir / "tiny-target.gguf", seed=TARGET_SEED, embedding_type="f32")
    draft = write_tiny_model(dir / "tiny-draft.gguf", seed=DRAFT_SEED, base=target, noise=DRAFT_NOISE)
    return target, draft
