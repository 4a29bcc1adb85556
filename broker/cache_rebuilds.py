"""After a re-plan the stages hold less than the sequences need: every cache is gone (reset_caches: each
active sequence re-prefills what it knows) or the stages kept all but a window of layers (replay_layers:
each replays its cached positions over those layers only). The scheduler's part of it: which sequences
rebuild, and the steps that rebuild them (_plan_replay). Part of Scheduler (broker/scheduler.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from layerbus.broker.prefix_cache import PrefixIndex, PrefixPlan
from layerbus.broker.sequences import PlannedRow, Sequence, StepPlan, _carries_a_chunk, prefill_chunk_end

if TYPE_CHECKING:
    from layerbus.planner.batching import BatchingConfig


class CacheRebuilds:
    """The rebuild half of Scheduler: it reads the scheduler's sequences, slots and prefix cache."""

    config: BatchingConfig
    active: dict[int, Sequence]
    pending_release: dict[int, list[int]]
    prefix_cache: PrefixIndex | None
    num_micro_batches: int
    window: tuple[int, int] | None
    replaying: set[int]
    replayed_last: list[bool]
    whole_turns: list[int]

    def _members(self, micro_batch: int) -> list[Sequence]: ...

    def _plan_replay(self, micro_batch: int) -> StepPlan | None:
        """A replay step for the micro-batch while any of its sequences replays (replay_layers): those
        sequences' cached positions, chunked as prefill is, over the window's layers only. Nothing else
        shares it (a replay step runs only some layers). None: no replay, or the turn of its sequences
        that are whole again (plan_step plans them as usual, without the replaying ones)."""
        if self.window is None:  # no replay under way: nothing to look at on the per-step path
            return None
        members = self._members(micro_batch)
        replaying = [seq for seq in members if seq.replay_end is not None]
        if not replaying:
            return None
        # Its sequences that are whole again get a step of their own (they decode, new items start): once
        # as soon as there are any, so the first new tokens come a few steps after a re-plan rather than
        # after the whole micro-batch's replay; then every other step once they are as many as those
        # replaying. Sooner, their steps would be a row or two that pass over every layer for little, and
        # they would slow the replay that all the others wait for.
        whole = sum(seq.replay_end is None for seq in members)
        turns = self.whole_turns[micro_batch]
        if whole and self.replayed_last[micro_batch] and (turns == 0 or whole >= len(replaying)):
            self.replayed_last[micro_batch] = False
            self.whole_turns[micro_batch] = turns + 1
            return None
        self.replayed_last[micro_batch] = True
        rows, budget = [], self.config.max_step_tokens
        for seq in replaying:
            end = min(seq.replay_end, prefill_chunk_end(seq.cached, len(seq.request.prompt_ids),
                                                        self.config.max_step_tokens))
            if end - seq.cached > budget and _carries_a_chunk(rows):
                continue  # its chunk waits for the next replay step, cut where it was first cut
            rows.append(PlannedRow(seq.slot, seq.cached, seq.known[seq.cached:end], emit=False))
            budget -= end - seq.cached
        released, self.pending_release[micro_batch] = self.pending_release[micro_batch], []
        return StepPlan(micro_batch, rows, released, window=self.window)

    def can_replay_layers(self) -> bool:
        """Whether the active sequences can replay a window of layers after a re-plan (replay_layers):
        not while an earlier replay is unfinished (its caches are partly rebuilt), nor for scored
        sequences, whose every position's logits are recomputed (reset_caches)."""
        return all(seq.replay_end is None and seq.feed is None and not seq.request.score_prompt
                   for seq in self.active.values())

    def replay_layers(self, window: tuple[int, int]) -> int:
        """The stages kept their caches but for the layers in `window` (broker.replay_window): every
        active sequence replays its cached positions over those layers before going on where it was.
        Returns the number of positions to replay."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()  # the stages' new arenas hold no prefix entries
        self.window = window
        self.replayed_last = [False] * self.num_micro_batches
        self.whole_turns = [0] * self.num_micro_batches
        total = 0
        self.replaying = set()
        for seq in self.active.values():
            if seq.prefix is not None:
                seq.prefix = PrefixPlan()  # a save it planned is gone with the entries; a restore was done
            if seq.cached == 0:
                continue
            seq.replay_end, seq.cached = seq.cached, 0
            self.replaying.add(seq.slot)
            total += seq.replay_end
        return total

    def reset_caches(self) -> int:
        """The stages lost their caches (a re-plan): every active sequence re-prefills what it knows,
        keeping its generated tokens. Returns the number of tokens to re-prefill."""
        self.window = None
        for releases in self.pending_release.values():
            releases.clear()  # the new stages start with empty caches
        if self.prefix_cache is not None:
            self.prefix_cache.clear()  # and no prefix entries
        total = 0
        self.replaying = set(self.active)
        for seq in self.active.values():
            seq.cached, seq.replay_end = 0, None
            seq.prefix = None  # its re-prefill may restore a prefix saved again by then
            if seq.feed is not None:
                seq.feed.restart()  # its phases rewind the slot anyway: start over, scores recomputed
                total += seq.feed.positions
                continue
            if seq.request.score_prompt:
                seq.prompt_logprobs.clear()  # scored again, identically, during the re-prefill
            if seq.grammar is not None:
                # From the tokens alone, so the next mask is the one an uninterrupted run would send.
                seq.grammar.rebuild(seq.generated)
            total += len(seq.known)
        return total
