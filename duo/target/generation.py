"""One request on the target (a Generation): its committed tokens, its draft's chain, and what each verify step
commits. The loop that steps every request lives in duo.target.target."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Callable, Sequence

import numpy as np

from duo.net import wire
from duo.net._proto import duo_pb2 as pb
from duo.constraint import GrammarError
from duo.lookup import ContextLookup
from duo.llama.model import Model
from duo.net.timeouts import within
from duo.sampling.distributions import SparseDist
from duo.sampling.ops.penalties import OutputCounts
from duo.sampling.verification import COUPLED, GREEDY, RESIDUAL, Verdict
from duo.target.batching import VerifyWork
from duo.target.chain import DraftChain
from duo.target.policy import AdaptivePolicy, DraftTiming, StepPlan
from duo.target.request import GenerationStats, Request, SpecSettings, Step, verification_of
from duo.target.switch import Switch
from duo.net.wire import ChainChunk

log = logging.getLogger("duo.target")

# Chunks that arrive closer together than this were sent apart but delivered together (the stream
# coalesces writes): their gap says nothing of the draft's pace.
COALESCED_S = 0.0005


class Generation:
    """One request on the target: the committed sequence grows by whatever each verify step accepts."""

    def __init__(self, session_id: int, request: Request, model: Model, settings: SpecSettings,
                 timing: DraftTiming | None = None, stats: GenerationStats | None = None) -> None:
        """`stats`: the counters to fill (the caller's, which it reads whenever the request ends); else new ones."""
        self.session_id = session_id
        self.request = request
        self.model = model
        self.settings = settings
        self.committed = list(request.prompt_tokens)
        self.chain = DraftChain(self.committed)
        self.verification = verification_of(request, settings.unseeded)
        # Coupled: the output is a function of this seed; residual: it seeds the target's own numbers.
        self.seed = request.seed if request.seed is not None else secrets.randbits(63)
        self.rng = np.random.default_rng(self.seed)
        self.stats = (stats if stats is not None
                      else GenerationStats(prompt_tokens=len(request.prompt_tokens), arrived=request.arrived))
        self.stats.verification, self.stats.seed = self.verification, 0 if self.verification == GREEDY else self.seed
        self.max_ahead = settings.max_ahead  # as last told to the draft
        self.policy: AdaptivePolicy | None = None  # this request's adaptive draft length, if adaptive
        self.chunk_arrived = asyncio.Event()  # set when chain tokens arrive (waiting steps wait on it)
        # How soon drafts come back after a commit, measured here for the waiting policy.
        self.timing = timing or DraftTiming()
        self.starved_since: float | None = None  # when a commit left this session without drafts
        self.last_commit_at = 0.0
        self.last_chunk_at = 0.0
        self.draft_silent = False  # a wait found nothing: wait no more until the draft sends again
        self.draft_refused = False  # the draft ended this session (SessionError) until it is opened again
        self.told = len(self.committed)  # committed tokens the draft has been sent (the open carries the prompt)
        self.cursor = request.constraint  # the output's grammar, walked along what is verified (duo.constraint)
        self.lookup = ContextLookup(self.committed) if settings.lookup else None
        self.split = (0, 0, 0)  # this step's drafts: from the model's chain, forced by the grammar, from the lookup
        # What the penalties count: the output's tokens, kept up at each commit (duo.sampling.ops.penalties).
        self.output_counts = OutputCounts(model.n_vocab) if request.penalties.active else None
        self.mu = request.params.start_mu()  # mirostat's state after the committed tokens (duo.sampling.ops.mirostat)
        self.switch: Switch | None = None  # judges this request's steps: its draft's switch, else the target's own

    # The pool of drafts calls this.
    def drafted_by(self, draft: str, timing: DraftTiming, switch: Switch) -> None:
        """The session is on `draft` now (placed, or moved): that draft's timing and switch judge its steps."""
        if self.switch is not None and self.switch is not switch:
            self.switch.request_done(self.session_id)
        self.timing, self.switch = timing, switch
        self.starved_since, self.draft_silent = None, False
        self.stats.draft = draft
        if self.policy is not None:
            self.policy.switch = switch

    # The draft's connection calls these.
    def open_message(self) -> pb.OpenSession:
        self.chain.reset()  # a (re)connected draft starts its epochs afresh
        self.draft_refused = False
        self.told = len(self.committed)
        return pb.OpenSession(session_id=self.session_id, committed=self.committed,
                              sampling=wire.sampling_to_pb(self.request.params, self.seed, self.request.penalties),
                              max_ahead=self.max_ahead, p_min=self.settings.draft_p_min,
                              verification=pb.COUPLED if self.verification == COUPLED else pb.RESIDUAL,
                              grammar=self.request.grammar, output_start=len(self.request.prompt_tokens),
                              lookup=self.settings.lookup, mirostat_mu=self.mu)

    def on_chunk(self, chunk: ChainChunk) -> None:
        """Chain tokens the link has checked against this session's bounds."""
        self.chain.receive(chunk.epoch, chunk.start, chunk.tokens, chunk.dists, chunk.branch_of, chunk.paused,
                           chunk.confidences)
        self.stats.draft_tokens_received = self.chain.received
        self.stats.branch_hits = self.chain.branch_hits
        if chunk.tokens and chunk.epoch == self.chain.epoch and chunk.branch_of is None:  # the draft's pace
            self._time_chunk(len(chunk.tokens))
        self.draft_silent = False
        self.chunk_arrived.set()

    def _time_chunk(self, n_tokens: int) -> None:
        """Learn the draft's latency after a commit that starved this session (the stats count it as the commit's
        round trip), and its pace per token while it drafts without a commit in between (so that no rest is
        counted)."""
        now = time.monotonic()
        if self.starved_since is not None and self.chain.has_pending():
            self.timing.latency.add(now - self.starved_since)
            self.stats.times.round_trips += 1
            self.stats.times.round_trip += now - self.starved_since
            self.starved_since = None
        elif self.last_chunk_at > self.last_commit_at and n_tokens and now - self.last_chunk_at > COALESCED_S:
            self.timing.per_token.add((now - self.last_chunk_at) / n_tokens)
        self.last_chunk_at = now

    def on_draft_lost(self) -> None:
        self.chain.reset()

    def on_draft_refused(self) -> None:
        """The draft will send nothing more for this session: no step waits for it."""
        self.draft_refused = True
        self.chunk_arrived.set()

    async def wait_for_drafts(self, enough: Callable[[list[int]], bool], seconds: float) -> None:
        """Wait until enough(pending drafts) holds or `seconds` have passed, checking at each chunk."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not enough(self.chain.pending()[0]):
            self.chunk_arrived.clear()
            try:
                await within(self.chunk_arrived.wait(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                return

    async def verify_work(self, seq: int, room: int, plan: StepPlan, prompt_tail: Sequence[int] = ()) -> VerifyWork:
        """This step's work for the batched call, as `plan`ned: the pending drafts it may verify (`room`: positions
        the context has left; the batch never runs past it), the model's chain first, then free drafts.
        Under a grammar the drafts are checked on a worker thread: llguidance's calls can take a while, and some
        hold the GIL, so none runs on the event loop."""
        pending, dists = self.chain.pending()
        if not plan.chain:
            pending, dists = [], []  # the draft rests: its chain waits, free drafts may still pay
        if self.verification == RESIDUAL and None in dists:
            pending = pending[:dists.index(None)]  # rejection sampling needs the q each token came from
        # k drafts in the batch commit k + 1 tokens at most: the context must hold them all.
        limit = max(0, min(self.settings.draft_max, room - 2))
        if self.cursor is None:
            pending, forced, found = self._drafts(pending, limit)
            masks = None
        else:  # the grammar looks at the tokens generated so far
            output = self.committed[len(self.request.prompt_tokens):]
            pending, forced, found, masks = await asyncio.to_thread(self._constrained_drafts, pending, output, limit)
        free = forced + found
        self.split = (len(pending), len(forced), len(found))
        dists = dists[:len(pending)] + [SparseDist.point(token) for token in free]
        if plan.policy is not None:  # where this step's drafts turn free, and to the lookup's: the policy's rates
            plan.policy.free_from = len(pending) if free else None
            plan.policy.lookup_from = len(pending) + len(forced) if found else None
            plan.policy.judge_pending(self.chain.pending_confidences()[:len(pending)] if plan.chain else [])
        pending = pending + free
        return VerifyWork(seq=seq, pos=len(self.committed) - 1, last=self.committed[-1], pending=pending,
                          dists=dists, limit=min(len(pending), limit), draft_min=self.settings.draft_min,
                          policy=plan.policy,
                          params=self.request.params, rng=self.rng,
                          coupled_seed=self.seed if self.verification == COUPLED else None,
                          masks=masks, penalties=self.request.penalties, counted=self.output_counts,
                          logprobs=self.request.logprobs, post_sampling=self.request.post_sampling,
                          committed=self.committed, mu=self.mu,
                          prompt_tail=prompt_tail)

    def _drafts(self, pending: list[int], limit: int) -> tuple[list[int], list[int], list[int]]:
        """The chain's drafts and the free drafts after them (_free_drafts)."""
        # Drafts past the batch's `limit` still count: the batch's last row checks the first of them.
        forced, found = self._free_drafts(pending, limit + 1) if len(pending) <= limit else ([], [])
        return pending, forced, found

    def _constrained_drafts(self, pending: list[int], output: list[int],
                            limit: int) -> tuple[list[int], list[int], list[int], list[np.ndarray]]:
        """Under the grammar, on a worker thread: the chain's drafts it allows (a draft it forbids would be rejected:
        no verify row is spent on it, nor on what follows), the free drafts after them, and the masks of the rows
        the batch may verify, so that the model thread every request shares computes none."""
        if not self.cursor.move_to(output):  # llguidance's mask allowed a token its matcher then refused
            refused = output[len(self.cursor.tokens)]
            raise GrammarError(f"the grammar refuses token {refused} ({self.model.token_piece(refused, special=True)!r}) "
                               "that its own mask allowed: write markup such as <tool_call> in a grammar as its "
                               "token (<[id]> in Lark), not as text")
        first = self.cursor.allowed()  # first: it builds the lexer states forced() needs without the GIL
        pending, forced, found = self._drafts(pending[:self.cursor.valid_prefix(pending)], limit)
        return pending, forced, found, [first, *self.cursor.masks_after(output, (pending + forced + found)[:limit])]

    def _free_drafts(self, pending: list[int], limit: int) -> tuple[list[int], list[int]]:
        """Drafts that cost no drafting, proposed with certainty (q = 1: residual verification accepts one with
        probability p(x), else samples p without it; another tokenization of the same text stays allowed, so the
        target may still say otherwise): where the model's chain is empty, the text the grammar forces (`{"name":
        "` of a schema); after the chain, what the context lookup finds (duo.lookup). Both, at most `limit`
        drafts in all with `pending`."""
        forced = (self.cursor.forced() if self.cursor is not None and not pending else [])[:limit - len(pending)]
        if forced:  # llguidance tokenizes forced text as the tokenizer would: "<tool_call>" as the special token,
            forced = forced[:self.cursor.valid_prefix(forced)]  # which the grammar's text does not allow
        before = pending + forced
        found = self.lookup.propose(before, limit - len(before)) if self.lookup else []
        if self.cursor is not None and found:
            found = found[:self.cursor.valid_prefix(before + found) - len(before)]
        return forced, found

    def commit(self, verdict: Verdict, n_verified: int, batch_size: int) -> Step:
        """Append the verdict's tokens, stopping at an end of generation or the token limit."""
        tokens, finish = [], None
        for token in verdict.tokens:
            if self.model.is_end_of_generation(token):
                finish = "stop"
                break
            tokens.append(token)
            if self.request.max_tokens and self.stats.generated_tokens + len(tokens) >= self.request.max_tokens:
                finish = "length"
                break
        self.committed.extend(tokens)
        self.mu = verdict.mu  # what the verdict's tokens left (a stop cut short ends the request)
        if self.output_counts is not None:
            self.output_counts.extend(tokens)
        self.chain.on_commit()
        self.last_commit_at = time.monotonic()
        self.starved_since = None if self.chain.has_pending() else self.last_commit_at
        self.stats.branch_hits = self.chain.branch_hits
        self.stats.generated_tokens += len(tokens)
        self.stats.verify_steps += 1
        sizes = self.stats.batch_sizes
        sizes.extend([0] * (batch_size + 1 - len(sizes)))
        sizes[batch_size] += 1
        self.stats.draft_tokens_verified += n_verified
        self.stats.draft_tokens_accepted += min(verdict.n_accepted, len(tokens))
        chain, forced, found = self.split  # the lookup's drafts follow the chain's and the forced ones
        before = chain + forced
        self.stats.lookup_tokens_verified += max(0, min(n_verified, before + found) - before)
        self.stats.lookup_tokens_accepted += max(0, min(verdict.n_accepted, len(tokens), before + found) - before)
        self.stats.draft_rejections += verdict.n_accepted < n_verified
        return Step(tokens, finish, verdict.logprobs[:len(tokens)] if verdict.logprobs is not None else None,
                    Step.sources_of(self.split, verdict.n_accepted, len(tokens)))
