"""Continuous batching over micro-batches: which tokens each micro-batch sends next.

Pure bookkeeping, no sockets or clocks: the pipeline loop asks `plan_step(mb)` for a micro-batch's
next step and feeds the last stage's answer to `apply_result`. Slots are grouped into micro-batches
of adjacent slots; a slot freed by a finished sequence is refilled at that micro-batch's very next
step, without waiting for its neighbours. Long prompts are prefilled in chunks under a per-step
token budget, so one prefill cannot stall the pipeline. Once the queue is empty (a job's tail),
decoding sequences move between micro-batches so that none runs full while another runs empty.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable

from layerbus.broker.detokenizer import IncrementalDetokenizer
from layerbus.broker.prefix_cache import PrefixIndex, PrefixPlan
from layerbus.broker.requests import GenerationRequest, GenerationResult, ScoreRequest
from layerbus.broker.cache_rebuilds import CacheRebuilds
from layerbus.broker.scoring import ScoringFeed
from layerbus.broker.speculation import Speculation, taken_tokens
from layerbus.broker.sequences import (  # noqa: F401 - the scheduler's records, imported from here too
    PlannedRow,
    Request,
    Sequence,
    StepPlan,
    _carries_a_chunk,
    _failed,
    _save_reached,
    _token_texts,
    prefill_chunk_end,
    read_new_text,
)
from layerbus.planner.batching import BatchingConfig
from layerbus.wire.constraint import Constraint

if TYPE_CHECKING:
    from layerbus.broker.grammar import TokenGrammar



class Scheduler(CacheRebuilds):
    """Slots, micro-batches and sequences. `new_detokenizer` gives each admitted sequence its own
    detokenizer, for stop strings and the result's text; without one, both are left out."""

    def __init__(self, config: BatchingConfig, num_stages: int, eos_ids: set[int],
                 new_detokenizer: Callable[[], IncrementalDetokenizer] | None = None,
                 new_grammar: Callable[[Constraint], TokenGrammar] | None = None,
                 prefix_cache: PrefixIndex | None = None):
        config = config.resolved(num_stages)
        # A constrained request's grammar state, built at submit (so a constraint that does not compile fails its
        # request there) and handed to its sequence at admission. None: constrained requests fail.
        self.new_grammar = new_grammar
        self.grammars: dict[str, TokenGrammar] = {}  # request_id -> grammar of a waiting request
        # Shared prompt prefixes computed once (broker.prefix_cache); None: every prompt prefilled whole.
        self.prefix_cache = prefix_cache
        self.config = config
        self.num_micro_batches = config.num_micro_batches
        self.eos_ids = set(eos_ids)
        self.new_detokenizer = new_detokenizer
        # Micro-batch j owns the adjacent slots [bounds[j], bounds[j+1]).
        base, extra = divmod(config.num_slots, self.num_micro_batches)
        sizes = [base + (1 if j < extra else 0) for j in range(self.num_micro_batches)]
        self.slots_of = []
        start = 0
        for size in sizes:
            self.slots_of.append(list(range(start, start + size)))
            start += size
        self.waiting: deque[Request] = deque()
        self.active: dict[int, Sequence] = {}  # slot -> sequence
        self.pending_release: dict[int, list[int]] = {j: [] for j in range(self.num_micro_batches)}
        self.replaying: set[int] = set()  # slots still re-prefilling after reset_caches
        # id(request) -> (request, its prefix block hashes), for the admission order; the request is held so
        # that its id is not reused while the entry lives.
        self.waiting_hashes: dict[int, tuple[Request, list[bytes]]] = {}
        self.head_passed = 0  # admissions that passed over the queue's head for a shared prefix
        self.window: tuple[int, int] | None = None  # the layers replayed after a re-plan that kept caches
        self.replayed_last = [False] * self.num_micro_batches  # whether a micro-batch's last step was a replay
        self.whole_turns = [0] * self.num_micro_batches  # steps given to its whole sequences during the replay
        self.speculation = Speculation(config.speculation)  # drafts on decode rows (off: none)

    # -- queue --------------------------------------------------------------------------------
    def submit(self, request: Request, now: float) -> GenerationResult | None:
        """Queue a request; a prompt that can never fit is answered at once with an error."""
        if isinstance(request, ScoreRequest):
            return self._submit_scoring(request)
        prompt_len = len(request.prompt_ids)
        if prompt_len == 0:
            return _failed(request, "empty prompt: nothing to generate from")
        if request.max_new_tokens < 1:
            return _failed(request, f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in request.prompt_ids):
            return _failed(request, "prompt_ids must be a list of integer token ids")
        if prompt_len + 1 > self.config.max_context:
            return _failed(request, f"prompt of {prompt_len} tokens does not fit the context of "
                                    f"{self.config.max_context} tokens (with at least one new token); "
                                    "shorten the input or raise --max-context up to the model's limit")
        if request.constraint is not None:
            if self.new_grammar is None:
                return _failed(request, "constrained decoding needs the model's tokenizer, which this broker lacks")
            try:
                self.grammars[request.request_id] = self.new_grammar(request.constraint)
            except ValueError as error:
                return _failed(request, str(error))
        self.waiting.append(request)
        return None

    def _submit_scoring(self, request: ScoreRequest) -> GenerationResult | None:
        if not request.segments:
            return _failed(request, "a score request needs at least one segment")
        if request.max_position > self.config.max_context:
            return _failed(request, f"context and continuation reach position {request.max_position}, past the "
                                    f"context of {self.config.max_context} tokens; truncate the context to fit "
                                    "(evals do, as lm-evaluation-harness does) or raise --max-context up to the "
                                    "model's limit")
        self.waiting.append(request)
        return None

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def free_slots(self) -> int:
        return self.config.num_slots - len(self.active)

    # -- planning -----------------------------------------------------------------------------
    def plan_step(self, micro_batch: int, now: float) -> StepPlan | None:
        """The next step for a micro-batch, admitting waiting requests into its free slots: a decode row for
        every sequence past its prefill, then prefill chunks (of prompts, or of an eval's contexts and
        continuations) as far as the step's token budget goes."""
        replay = self._plan_replay(micro_batch)
        if replay is not None:
            return replay
        self._balance_tail(micro_batch)
        self._admit(micro_batch, now)
        released, self.pending_release[micro_batch] = self.pending_release[micro_batch], []
        # (Sequences still replaying after a re-plan go only in replay steps: _plan_replay.)
        sequences = [seq for seq in self._members(micro_batch) if seq.replay_end is None]
        suspects = [seq for seq in sequences if seq.suspect]
        if suspects:
            # After a failed step, its sequences run one per step until each has passed one, so a
            # sequence that fails alone is the one to blame (see fail_step).
            sequences = suspects[:1]
        decoding = [seq for seq in sequences if not seq.prefilling]
        rows = self.speculation.decode_rows(decoding, len(decoding), self.eos_ids, self.config.max_context)
        budget = self.config.max_step_tokens - sum(len(row.tokens) for row in rows)
        # A sequence saving a shared prefix goes first: the ones waiting for that prefix copy it once it is
        # saved, so a saver left behind them (an eval's fixed-size chunks wait for room) holds them all up.
        for seq in sorted(sequences, key=lambda s: s.prefix is None or s.prefix.save is None):
            if not seq.prefilling or (budget <= 0 and _carries_a_chunk(rows)):
                continue
            chunk = (self._scoring_chunk(seq, rows, budget, len(decoding)) if seq.feed is not None
                     else self._prompt_chunk(seq, rows, budget))
            if chunk is not None:
                rows.append(chunk)
                budget -= len(chunk.tokens)
        if not rows and not released:
            return None
        drops = self.prefix_cache.take_drops() if self.prefix_cache is not None else []
        return StepPlan(micro_batch, sorted(rows, key=lambda row: row.slot), released, drops)

    def _admit(self, micro_batch: int, now: float) -> None:
        """Waiting requests into the micro-batch's free slots. When fewer sequences are known than there are
        slots (a small job, or a job's tail), each micro-batch takes at most its even share of them: filling the
        first micro-batch's slots and leaving the others empty would leave stages idle for want of
        micro-batches in flight."""
        share = -(-(len(self.waiting) + len(self.active)) // self.num_micro_batches)
        # (Capped at its size: after a tail's moves it may carry sequences of other micro-batches' slots.)
        share = min(share, self.config.micro_batch_size)
        admitted = len(self._members(micro_batch))
        for slot in self.slots_of[micro_batch]:
            if admitted >= share:
                break
            if slot not in self.active and self.waiting:
                admitted += 1
                request = self._next_waiting()
                if isinstance(request, ScoreRequest):
                    self._taken_hashes(request)  # its feed hashes its opening context itself
                    self.active[slot] = Sequence(request, slot, admitted_at=now, micro_batch=micro_batch,
                                                 feed=ScoringFeed(request))
                    continue
                detokenizer = self.new_detokenizer() if self.new_detokenizer is not None else None
                self.active[slot] = Sequence(request, slot, admitted_at=now, micro_batch=micro_batch,
                                             detokenizer=detokenizer,
                                             grammar=self.grammars.pop(request.request_id, None),
                                             prefix_hashes=self._taken_hashes(request))

    def _scoring_chunk(self, seq: Sequence, rows: list[PlannedRow], budget: int, decode_rows: int) -> PlannedRow | None:
        """An eval sequence's next chunk (its context, then its continuations), or None: it waits."""
        restore = None
        context = seq.feed.opening_context() if self.prefix_cache is not None and seq.prefix is None else None
        if context is not None:
            # An eval's context (its few-shot examples, its instructions) goes through the prefix
            # cache like a prompt: restored where an earlier request saved it, saved when seen again.
            if seq.prefix_hashes is None:
                seq.prefix_hashes = self.prefix_cache.hashes(context)
            if rows and self.prefix_cache.should_wait(context, seq.prefix_hashes):
                return None
            seq.prefix = self.prefix_cache.plan_prompt(context, seq.prefix_hashes, seq.feed.positions)
            restore = seq.prefix.restore
            if restore is not None:
                seq.feed.skip_restored(restore[1])
        # Chunks of max_step_tokens, cut at the same places whatever else shares the step, so a
        # document's scores depend on its neighbours, the batch or a re-plan only through the
        # rounding of padded batches (<= 1e-5), never through what it attends over (lm-eval's move
        # with batch size: its issues #704, #1645). A chunk that does not fit what is
        # left of the step waits for the next one, unless the step carries no other chunk yet (decode
        # rows alone never hold it back: the step then runs a little over budget rather than starve it).
        # (A restored context starts its chunks past the copy: the same places for the same cache.)
        chunk = seq.feed.next_chunk(self.config.max_step_tokens)
        if len(chunk.tokens) > budget and len(rows) > decode_rows and restore is None:
            return None
        save = _save_reached(seq, chunk.start + len(chunk.tokens)) if chunk.targets is None else None
        return PlannedRow(seq.slot, chunk.start, chunk.tokens, emit=False, targets=chunk.targets, restore=restore,
                          save=save)

    def _prompt_chunk(self, seq: Sequence, rows: list[PlannedRow], budget: int) -> PlannedRow | None:
        """A generating sequence's next chunk of what it knows (its prompt, or after a re-plan its generated
        tokens too), cut where every run cuts it (prefill_chunk_end); None: it waits."""
        known = seq.known
        start, restore = seq.cached, None
        if (self.prefix_cache is not None and seq.cached == 0 and seq.prefix is None
                and not seq.request.score_prompt):  # scored prompts need every position's logits
            prompt_ids = seq.request.prompt_ids
            if seq.prefix_hashes is None:
                seq.prefix_hashes = self.prefix_cache.hashes(prompt_ids)
            if rows and self.prefix_cache.should_wait(prompt_ids, seq.prefix_hashes):
                return None  # its prefix is being saved: copy it in a step or two rather than compute it
            seq.prefix = self.prefix_cache.plan_prompt(prompt_ids, seq.prefix_hashes)
            restore = seq.prefix.restore
            start = restore[1] if restore is not None else 0
        chunk = known[start:prefill_chunk_end(start, len(seq.request.prompt_ids), self.config.max_step_tokens)]
        if len(chunk) > budget and _carries_a_chunk(rows) and restore is None:
            return None  # it waits for a step with room rather than be cut elsewhere
        end = start + len(chunk)
        prompt = seq.request.prompt_ids
        # Prompt scoring covers prompt positions only; a re-prefill after a recovery scores them again.
        targets = prompt[start + 1:min(end, len(prompt)) + 1] if seq.request.score_prompt else None
        targets = targets[:len(chunk)] if targets else None
        # Only the first prefill ends with a new token: after a re-prefill, the last generated
        # token is already known and the next decode step feeds it.
        return PlannedRow(seq.slot, start, chunk, emit=end == len(known) and not seq.generated, targets=targets,
                          restore=restore, save=_save_reached(seq, end))

    def _members(self, micro_batch: int) -> list[Sequence]:
        """The active sequences this micro-batch's steps carry, in slot order."""
        return sorted((seq for seq in self.active.values() if seq.micro_batch == micro_batch),
                      key=lambda seq: seq.slot)

    def _balance_tail(self, micro_batch: int) -> None:
        """At a job's tail (nothing waiting), hand this micro-batch's decoding sequences beyond an even share
        to the micro-batches with the fewest. Sequences end at their own lengths, so without this one
        micro-batch can run full while another runs empty, and a pipeline of S stages then has fewer than S
        steps in flight: stages sit idle while the tail's tokens queue behind one another. The micro-batch
        being planned has nothing in flight, so its sequences can go; they join the others' next steps. Not
        while a replay or a suspect step is being sorted out, nor for prefilling or scored sequences (their
        chunks and prefix copies are planned per micro-batch turn)."""
        if self.waiting or self.num_micro_batches == 1 or self.window is not None:
            return
        if any(seq.suspect for seq in self.active.values()):
            return
        counts = [0] * self.num_micro_batches
        for seq in self.active.values():
            counts[seq.micro_batch] += 1
        target = -(-sum(counts) // self.num_micro_batches)
        movable = [seq for seq in self._members(micro_batch)
                   if seq.feed is None and not seq.prefilling and seq.replay_end is None]
        while counts[micro_batch] > target and movable:
            receiver = min(range(self.num_micro_batches), key=lambda j: (counts[j], j))
            if counts[receiver] + 1 >= counts[micro_batch]:
                break  # moving one would only swap which is larger
            seq = movable.pop()
            seq.micro_batch = receiver
            counts[micro_batch] -= 1
            counts[receiver] += 1

    def _next_waiting(self) -> Request:
        """The next request to admit: the queue's head, unless one of the next few shares more of its
        prefix with what the stages hold or recently saw (PrefixCacheConfig.admit_lookahead). Items of
        one prefix then go in close together, so the cache saves it while it is in use and restores it
        for the rest, where a queue of interleaved prefixes would have them evicted in between. The
        head is passed over at most `admit_lookahead` times, so no item waits for ever."""
        index = self.prefix_cache
        lookahead = index.config.admit_lookahead if index is not None else 1
        if lookahead <= 1 or len(self.waiting) == 1 or self.head_passed >= lookahead:
            return self._admit_at(0)
        best, best_shared = 0, -1
        for i in range(min(lookahead, len(self.waiting))):
            shared = index.shared_blocks(self._waiting_hashes_of(self.waiting[i]))
            if shared > best_shared:
                best, best_shared = i, shared
        return self._admit_at(best)

    def _admit_at(self, i: int) -> Request:
        self.head_passed = self.head_passed + 1 if i else 0
        request = self.waiting[i]
        del self.waiting[i]
        return request

    def _waiting_hashes_of(self, request: Request) -> list[bytes]:
        """A waiting request's prefix block hashes, computed once (its sequence takes them at admission)."""
        known = self.waiting_hashes.get(id(request))  # by object: ids given by a caller need not be unique
        if known is not None and known[0] is request:
            return known[1]
        tokens = request.prompt_ids if isinstance(request, GenerationRequest) else request.segments[0].context_ids
        hashes = self.prefix_cache.hashes(list(tokens))
        self.waiting_hashes[id(request)] = (request, hashes)
        return hashes

    def _taken_hashes(self, request: Request) -> list[bytes] | None:
        """The hashes the admission order computed for `request`, now admitted (None: none computed)."""
        known = self.waiting_hashes.pop(id(request), None)
        return known[1] if known is not None and known[0] is request else None

    def token_mask(self, slot: int) -> bytes | None:
        """The allow-bitmask for the next token of the sequence in `slot`, None when it is unconstrained."""
        grammar = self.active[slot].grammar
        return grammar.mask() if grammar is not None else None

    # -- results ------------------------------------------------------------------------------
    def apply_result(self, plan: StepPlan, tokens: dict[int, tuple[int, float]], now: float,
                     scores: dict[int, tuple[list[float], list[bool]]] | None = None,
                     accepted: dict[int, list] | None = None) -> list[GenerationResult]:
        """Advance each row's sequence; `tokens` maps slot -> (token, logprob) for emitting rows,
        `scores` slot -> (log-probs of the row's targets, whether each target was the argmax), `accepted`
        slot -> the (token, logprob) of each draft the last stage accepted before that token."""
        finished = []
        for row in plan.rows:
            seq = self.active[row.slot]
            self._prefix_ops_done(seq, row)
            if seq.feed is not None:
                logprobs, greedy = (scores or {}).get(row.slot, (None, None))
                seq.feed.apply(len(row.tokens), logprobs if row.targets else None, greedy if row.targets else None)
                seq.suspect = False
                if seq.feed.done:
                    self.replaying.discard(row.slot)
                    finished.append(self._finish(seq, "stop", now))
                continue
            taken = taken_tokens(row, tokens[row.slot], (accepted or {}).get(row.slot)) if row.drafts else None
            # A row's rejected drafts are not cached: the next step starts after its accepted ones, and each stage
            # rewinds the slot there, dropping the rest (stages/kv_cache.py, prepare_rows).
            seq.cached = row.start + (len(taken) if taken is not None else len(row.tokens))
            seq.suspect = False
            if plan.window is not None:
                if seq.cached >= seq.replay_end:
                    seq.replay_end = None  # its caches are whole again: on where it was
                    if all(other.replay_end is None for other in self.active.values()):
                        self.window = None  # the replay is over
                    if not seq.prefilling:
                        self.replaying.discard(row.slot)
                continue
            if not seq.prefilling:
                self.replaying.discard(row.slot)
            if row.targets:
                seq.prompt_logprobs.extend((scores or {}).get(row.slot, ([], []))[0])
            if not row.emit:
                continue
            entries = taken if taken is not None else [tokens[row.slot]]
            if seq.generated:  # a decode row (not a prompt's last chunk): a trip of the sequence down the chain
                self.speculation.verified(row.drafts, len(entries) - 1, len(entries))
            for entry in entries:
                result = self._take_token(seq, entry, now)
                if result is not None:  # it ended here: any tokens after this one are dropped, as a run without
                    finished.append(result)  # drafts never computes them
                    break
        return finished

    def _take_token(self, seq: Sequence, entry: tuple, now: float) -> GenerationResult | None:
        """Append one picked token (token, logprob[, top]) to the sequence; its result when it ends there."""
        token, logprob, *top = entry
        seq.generated.append(token)
        seq.logprobs.append(logprob)
        if seq.request.top_logprobs:
            seq.top_logprobs.append([(int(i), float(lp)) for i, lp in top[0]] if top else [])
        broken = seq.grammar.advance(token) if seq.grammar is not None and token not in self.eos_ids else None
        if broken:  # the last stage ignored the mask (a stage of another version): never hand it back as valid
            return self._finish(seq, "error", now, broken)
        read_new_text(seq, token)
        reason = self._finish_reason(seq)
        return self._finish(seq, reason, now) if reason else None

    def _prefix_ops_done(self, seq: Sequence, row: PlannedRow) -> None:
        """The row's restore and save came back from the last stage: the save is held everywhere now."""
        if row.restore is not None or row.save is not None:
            self.prefix_cache.step_done(row.restore, row.save)
            if row.save is not None:
                seq.prefix.save = None

    def fail_step(self, plan: StepPlan, error: str, now: float) -> list[GenerationResult]:
        """A stage could not run this step. Its sequences become suspects and retry one per step, which
        tells the culprit from its neighbours; a sequence that fails alone `max_step_failures` times
        ends with the stage's error (a poison item), and the others go on."""
        finished = []
        for row in plan.rows:
            seq = self.active.get(row.slot)
            if seq is None:
                continue
            if row.restore is not None or row.save is not None:
                # The sequence computes its prefix itself next time; a partial save is dropped.
                self.prefix_cache.step_failed(row.restore, row.save)
                seq.prefix = PrefixPlan()
                if row.restore is not None and seq.feed is not None:
                    seq.feed.unskip()
            seq.suspect = True
            if len(plan.rows) == 1:
                seq.failures += 1
                if seq.failures >= self.config.max_step_failures:
                    finished.append(self._finish(seq, "error", now, f"{error} (failed alone {seq.failures} time(s))"))
        # The failed step's released slots were not released on the stages past the failure, nor its drops.
        self.pending_release[plan.micro_batch].extend(plan.released)
        if plan.dropped_prefixes:
            self.prefix_cache.drop_again(plan.dropped_prefixes)
        return finished

    def _finish_reason(self, seq: Sequence) -> str | None:
        if seq.generated[-1] in self.eos_ids:
            return "stop"
        if seq.stop_at is not None:
            return "stop"
        if len(seq.generated) >= seq.request.max_new_tokens:
            return "length"
        if len(seq.request.prompt_ids) + len(seq.generated) >= self.config.max_context:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, now: float, error: str | None = None) -> GenerationResult:
        del self.active[seq.slot]
        self.speculation.finished(seq)
        if seq.prefix is not None and seq.prefix.save is not None:
            self.prefix_cache.abandon(seq.prefix.save)  # it ended before its prefill reached the save
        self.replaying.discard(seq.slot)
        self.pending_release[self._micro_batch_of(seq.slot)].append(seq.slot)
        request = seq.request
        if seq.feed is not None:
            return GenerationResult(request_id=request.request_id, token_ids=[], finish_reason=reason,
                                    prompt_tokens=seq.feed.positions, error=error, latency_s=now - seq.admitted_at,
                                    scores=seq.feed.scores() if error is None else None)
        stop_at = seq.stop_at if reason == "stop" else None
        text = None
        if seq.detokenizer is not None:
            seq.detokenizer.extend(seq.generated[len(seq.detokenizer.ids):])  # what was not read token by token
            text = seq.detokenizer.finish()[:stop_at]
        return GenerationResult(
            request_id=request.request_id, token_ids=list(seq.generated),
            finish_reason=reason, prompt_tokens=len(request.prompt_ids), error=error,
            latency_s=now - seq.admitted_at,
            logprobs=list(seq.logprobs) if request.want_logprobs else None,
            top_logprobs=list(seq.top_logprobs) if request.want_logprobs and request.top_logprobs else None,
            token_texts=_token_texts(seq) if request.want_logprobs or request.score_prompt else None,
            prompt_logprobs=list(seq.prompt_logprobs) if request.score_prompt else None,
            prompt_ids=list(request.prompt_ids) if request.score_prompt else None,
            stop_text_end=stop_at, text=text)

    def _micro_batch_of(self, slot: int) -> int:
        for j, slots in enumerate(self.slots_of):
            if slots and slots[0] <= slot <= slots[-1]:
                return j
        raise KeyError(slot)
