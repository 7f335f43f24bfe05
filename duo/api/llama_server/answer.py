"""What llama-server's native /completion and /infill answer: content, tokens, stop and timings, whole or one JSON
object per event."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from duo.api.llama_server.settings import generation_settings
from duo.api.openai.answers import sse
from duo.api.openai.errors import api_error, generation_error
from duo.api.output.logprobs import native_probabilities
from duo.api.output.progress import progress_event
from duo.api.output.timings import timings
from duo.api.serving.choices import Choice
from duo.api.serving.generate import Piece
from duo.api.serving.request import CompletionRequest, ShuttingDown


class NativeFormat:
    """llama-server's /completion answer: `content`, `tokens`, `stop`, `stop_type`, `timings` (with its names,
    draft_n and draft_n_accepted included); streamed as one JSON object per event, the last with stop true, and no
    [DONE] (llama-server sends none on its native endpoints)."""

    def __init__(self, model: str, response_fields: list[str] | None = None, *, context_size: int = 0,
                 detokenize: Callable[[Sequence[int]], str] | None = None, timings_per_token: bool = False) -> None:
        self.model = model
        self.timings_per_token = timings_per_token  # llama-server's: every event carries the timings so far
        self.response_fields = response_fields
        self.context_size = context_size  # an answer that filled it was cut short: `truncated`
        self.detokenize = detokenize  # the prompt's ids as text, special tokens spelled out: `prompt`
        self.request: CompletionRequest | None = None  # set once the body is translated: `generation_settings`
        self._new_line = False  # whether the streamed text so far held a line break

    def fields(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The answer's fields the client asked for in response_fields (all without it), each under its path
        ("timings/predicted_n": a nested one); a path to nothing is left out, as llama-server leaves it. None or
        an empty list: every field."""
        if not self.response_fields:
            return answer
        picked = {}
        for path in self.response_fields:
            value: Any = answer
            for key in path.split("/"):
                value = value.get(key, _MISSING) if isinstance(value, dict) else _MISSING
            if value is not _MISSING:
                picked[path] = value
        return picked

    def whole(self, pieces: list[Piece]) -> dict[str, Any]:
        self._new_line = any("\n" in piece.text for piece in pieces)
        answer = {**self._final(pieces[-1]), "content": "".join(piece.text for piece in pieces),
                  "tokens": [token for piece in pieces for token in piece.token_ids]}
        if pieces[-1].logprobs is not None:
            answer["completion_probabilities"] = native_probabilities([e for p in pieces for e in p.logprobs or []],
                                                                      self._post_sampling)
        return self.fields(answer)

    async def events(self, choice: Choice, include_usage: bool) -> AsyncIterator[str]:
        """`include_usage` does not apply: every answer carries its timings."""
        try:
            async for piece in choice:
                if piece.progress is not None:  # llama-server's: an event of no text, its prompt_progress
                    yield sse(progress_event({"index": 0, "content": "", "tokens": [], "stop": False,
                                              "id_slot": NO_SLOT, "tokens_predicted": 0,
                                              "tokens_evaluated": piece.progress.total},
                                             piece.progress, self.timings_per_token))
                    continue
                self._new_line = self._new_line or "\n" in piece.text
                event = {"index": 0, "content": piece.text, "tokens": piece.token_ids, "stop": False,
                         "id_slot": NO_SLOT}
                if piece.logprobs is not None:
                    event["completion_probabilities"] = native_probabilities(piece.logprobs, self._post_sampling)
                if self.timings_per_token:
                    event["timings"] = timings(piece.stats)
                if piece.finish_reason:
                    yield sse(self.fields({**event, **self._final(piece)}))
                elif piece.text or piece.token_ids:
                    yield sse(event)
        except ShuttingDown as error:
            yield sse(api_error(error).body())
        except Exception as error:  # this request's own failure: an error event, and the stream ends
            yield sse(generation_error(error).body())

    def _final(self, last: Piece) -> dict[str, Any]:
        """The fields of the last event (or the whole answer) beside its content and tokens; index 0 (several
        choices are numbered by duo.api.http.answering)."""
        stats = last.stats
        return {"index": 0, "id_slot": NO_SLOT, "stop": True, "model": self.model,
                "tokens_predicted": stats.generated_tokens, "tokens_evaluated": stats.prompt_tokens,
                "generation_settings": self._settings(last), "prompt": self._prompt(last),
                "has_new_line": self._new_line, "truncated": self._truncated(last), "stop_type": last.stop_type,
                "stopping_word": last.stop_word, "tokens_cached": stats.cached_prompt_tokens,
                "timings": timings(stats), "duo_stats": stats.fields(last.draft_connected)}

    def _settings(self, last: Piece) -> dict[str, Any]:
        if self.request is None:
            return {}
        sampled = not self.request.params.greedy  # the target draws a sampled request's seed where none was given
        settings = generation_settings(self.request, last.stats.seed if sampled else None, last.logit_bias)
        return {**settings, "timings_per_token": self.timings_per_token}

    @property
    def _post_sampling(self) -> bool:
        """Whether the probabilities are after the sampler chain (post_sampling_probs): their names say so."""
        return self.request is not None and self.request.post_sampling_probs

    def _prompt(self, last: Piece) -> str:
        return self.detokenize(last.prompt_tokens) if self.detokenize else ""

    def _truncated(self, last: Piece) -> bool:
        """Whether the answer stopped because the context was full (llama-server's `truncated`: duo never shifts
        the context, so it is the only way an answer is cut)."""
        stats = last.stats
        return (last.finish_reason == "length" and self.context_size > 0
                and stats.prompt_tokens + stats.generated_tokens >= self.context_size)


_MISSING = object()
# duo's running places are interchangeable, not numbered slots a request is pinned to: llama-server's "no particular
# slot" (the id_slot a request sends to let the server choose).
NO_SLOT = -1
