"""Which prompt prefixes the stages keep, and which a new sequence can start from: pure bookkeeping.

Every item of a summarize or translate job starts with the same tokens (the chat template's system part
and the task's instruction), and every question of a few-shot eval with the same examples. A stage can
keep the keys and values of such a prefix for its own layers and copy them into a new sequence's slot,
so the prefix is computed once per job instead of once per item.

Prompts are cut into blocks of `block_tokens`; a block is named by a hash of every token up to its end
(a chain: block k's hash covers blocks 1..k), so two prompts with equal hashes at block k share their
first k blocks, and a lookup can take the longest shared run from any saved prefix. The broker decides
everything and tells the stages in each step's header (wire/protocol.py, `prefix`):
- `save [slot, entry, length]`: after computing the step, copy the slot's first `length` positions into
  a new entry. The broker saves a prefix the second time it sees it (its blocks are in `seen`, from an
  earlier prompt): one repeat computes it twice, and no prompt's unique tail is ever kept on a guess.
- `restore [slot, entry, length]`: before computing, copy an entry's first `length` positions into the
  slot; the row then starts at `length`.
- `drop [entry, ...]`: free entries evicted (least recently used, within `budget_tokens`).
Every stage sees every step in the order the broker sent them, so all stages hold the same entries. An
entry is usable only once the step that saved it came back from the last stage (every stage then holds
it); one that a step in flight restores from is pinned, never evicted, so a resent step finds it again.
A re-plan empties the stages' caches, and with them every entry (`clear`).

Entries are whole copies, not pages of one shared pool: the stages keep one contiguous arena per slot
(stages/kv_cache.py), which the packed attention reads in place; a copy of a few hundred positions costs
far less than computing them (one layer's matmuls per position against one memcpy).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from layerbus.planner.prefix_budget import PrefixCacheConfig, block_hashes

# Block hashes remembered from earlier prompts (16 bytes each, plus the dict's own): enough for a few
# thousand prompts' prefixes, whatever the job's size.
SEEN_LIMIT = 65_536


@dataclass
class PrefixEntry:
    entry_id: int
    hashes: list[bytes]  # one per block held
    block_tokens: int
    committed: bool = False  # every stage holds it (the saving step came back)
    pins: int = 0  # steps in flight that restore from it

    @property
    def tokens(self) -> int:
        return len(self.hashes) * self.block_tokens


@dataclass
class PrefixStats:
    """What the cache did over a run: prompt tokens admitted, and how many of them a stage copied
    instead of computing."""

    prompts: int = 0
    prompt_tokens: int = 0
    hits: int = 0  # prompts that started from a saved prefix
    restored_tokens: int = 0
    saved_entries: int = 0
    evicted_entries: int = 0

    @property
    def hit_rate(self) -> float:
        return self.restored_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self) -> dict:
        return {"prompts": self.prompts, "prompt_tokens": self.prompt_tokens, "hits": self.hits,
                "restored_tokens": self.restored_tokens, "prefill_tokens_saved": self.restored_tokens,
                "hit_rate": round(self.hit_rate, 4), "saved_entries": self.saved_entries,
                "evicted_entries": self.evicted_entries}


@dataclass
class PrefixPlan:
    """What a new sequence's prefill does with the cache: its first step may restore, and the step
    whose chunk reaches the save's length saves."""

    restore: tuple[int, int] | None = None  # (entry, tokens) copied into the slot before computing
    save: tuple[int, int] | None = None  # (entry, tokens) copied out of the slot once computed


@dataclass
class PrefixIndex:
    """The entries the stages hold, as the broker told them to: lookups, saves, pins and eviction."""

    config: PrefixCacheConfig
    entries: OrderedDict[int, PrefixEntry] = field(default_factory=OrderedDict)  # least recently used first
    stats: PrefixStats = field(default_factory=PrefixStats)
    _by_hash: dict[bytes, int] = field(default_factory=dict)  # block hash -> a committed entry holding it
    _pending_by_hash: dict[bytes, int] = field(default_factory=dict)  # ... -> an entry whose save is in flight
    _seen: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    _drops: list[int] = field(default_factory=list)
    _next_id: int = 0

    @property
    def used_tokens(self) -> int:
        """Positions the stages hold, saves in flight included (what the budget bounds)."""
        return sum(entry.tokens for entry in self.entries.values())

    # -- a sequence's first step ------------------------------------------------------------------
    def hashes(self, prompt: list[int]) -> list[bytes]:
        return block_hashes(prompt, self.config.block_tokens)

    def should_wait(self, prompt: list[int], hashes: list[bytes]) -> bool:
        """Whether a prefix this prompt shares is being saved right now, longer than any it could restore:
        a sequence that waits a step or two for that save copies it instead of computing it again (at a
        job's start, a whole micro-batch of items with one system prompt would otherwise compute it)."""
        usable = (len(prompt) - 1) // self.config.block_tokens
        for blocks in range(usable, 0, -1):
            if hashes[blocks - 1] in self._by_hash:
                return False
            if hashes[blocks - 1] in self._pending_by_hash:
                return True
        return False

    def shared_blocks(self, hashes: list[bytes]) -> int:
        """Leading blocks of a prompt that an entry holds or is saving, or that a recent prompt had: what
        admitting it now would copy, or would make worth saving (Scheduler's admission order)."""
        shared = 0
        for digest in hashes:
            if digest not in self._by_hash and digest not in self._pending_by_hash and digest not in self._seen:
                break
            shared += 1
        return shared

    def plan_prompt(self, prompt: list[int], hashes: list[bytes] | None = None,
                    positions: int | None = None) -> PrefixPlan:
        """Where a new sequence's prefill starts, and what of it to keep. At least the prompt's last
        token is always computed: its logits give the first new token. `positions`: what the sequence
        prefills without the cache, for the figures (a scored request's context and continuations;
        default the prompt's length)."""
        block = self.config.block_tokens
        hashes = hashes if hashes is not None else block_hashes(prompt, block)
        self.stats.prompts += 1
        self.stats.prompt_tokens += len(prompt) if positions is None else positions
        plan = PrefixPlan()
        usable = (len(prompt) - 1) // block  # blocks that may be restored
        restored_blocks = 0
        for blocks in range(usable, 0, -1):
            entry_id = self._by_hash.get(hashes[blocks - 1])
            if entry_id is not None:
                entry = self.entries[entry_id]
                entry.pins += 1
                self.entries.move_to_end(entry_id)
                plan.restore = (entry_id, blocks * block)
                restored_blocks = blocks
                self.stats.hits += 1
                self.stats.restored_tokens += blocks * block
                break
        repeated = 0
        while repeated < len(hashes) and hashes[repeated] in self._seen:
            repeated += 1
        if repeated > restored_blocks and hashes[repeated - 1] not in self._pending_by_hash:
            entry_id = self._begin_save(hashes[:repeated])
            if entry_id is not None:
                plan.save = (entry_id, repeated * block)
        self._remember(hashes)
        return plan

    def _begin_save(self, hashes: list[bytes]) -> int | None:
        tokens = len(hashes) * self.config.block_tokens
        if tokens > self.config.budget_tokens or not self._evict_for(tokens):
            return None
        entry_id = self._next_id
        self._next_id += 1
        self.entries[entry_id] = PrefixEntry(entry_id, list(hashes), self.config.block_tokens)
        for digest in hashes:
            self._pending_by_hash.setdefault(digest, entry_id)
        return entry_id

    def _evict_for(self, tokens: int) -> bool:
        """Make room for `tokens` more positions by evicting unpinned committed entries, least recently used
        first; False (nothing evicted) when pinned or unfinished entries leave too little room."""
        room = self.config.budget_tokens - self.used_tokens
        victims = []
        for entry in self.entries.values():
            if room >= tokens:
                break
            if entry.committed and entry.pins == 0:
                victims.append(entry.entry_id)
                room += entry.tokens
        if room < tokens:
            return False
        for entry_id in victims:
            self._forget(entry_id)
            self.stats.evicted_entries += 1
        return True

    def _remember(self, hashes: list[bytes]) -> None:
        for digest in hashes:
            self._seen[digest] = None
            self._seen.move_to_end(digest)
        while len(self._seen) > SEEN_LIMIT:
            self._seen.popitem(last=False)

    # -- a step's outcome --------------------------------------------------------------------------
    def step_done(self, restore: tuple[int, int] | None, save: tuple[int, int] | None) -> None:
        """A step carrying these ops came back from the last stage: a save is held everywhere now."""
        if restore is not None:
            self._unpin(restore[0])
        if save is not None and save[0] in self.entries:
            entry = self.entries[save[0]]
            entry.committed = True
            self.stats.saved_entries += 1
            for digest in entry.hashes:
                self._by_hash.setdefault(digest, entry.entry_id)
                if self._pending_by_hash.get(digest) == entry.entry_id:
                    del self._pending_by_hash[digest]

    def step_failed(self, restore: tuple[int, int] | None, save: tuple[int, int] | None) -> None:
        """A step carrying these ops failed. Its sequence computes the restored part itself on its next
        try; stages before the failure may hold the save's copy, and drop it."""
        if restore is not None:
            self._unpin(restore[0])
            self.stats.hits -= 1
            self.stats.restored_tokens -= restore[1]
        if save is not None:
            self.abandon(save)

    def abandon(self, save: tuple[int, int]) -> None:
        """A save that will not happen (its sequence ended, or its step failed): free its room."""
        entry = self.entries.get(save[0])
        if entry is not None and not entry.committed:
            self._forget(save[0])

    def _unpin(self, entry_id: int) -> None:
        entry = self.entries.get(entry_id)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def _forget(self, entry_id: int) -> None:
        entry = self.entries.pop(entry_id)
        for digest in entry.hashes:
            if self._pending_by_hash.get(digest) == entry_id:
                del self._pending_by_hash[digest]
            if self._by_hash.get(digest) == entry_id:
                del self._by_hash[digest]
                # Another committed entry may hold the same block: keep it findable.
                for other in self.entries.values():
                    if other.committed and digest in other.hashes:
                        self._by_hash[digest] = other.entry_id
                        break
        self._drops.append(entry_id)

    def drop_again(self, entry_ids: list[int]) -> None:
        """Drops a failed step carried: stages past the failure did not see them."""
        self._drops.extend(entry_ids)

    def take_drops(self) -> list[int]:
        """Entries the stages may free, told once (in the next step sent)."""
        drops, self._drops = self._drops, []
        return drops

    def start_run(self) -> None:
        """A new run on the same stages: entries every stage holds are kept; saves the last run never
        finished (items handed back when it stopped) are dropped, and the figures start again."""
        for entry in [e for e in self.entries.values() if not e.committed]:
            self._forget(entry.entry_id)
        for entry in self.entries.values():
            entry.pins = 0  # no step is in flight between runs
        self.stats = PrefixStats()

    def clear(self) -> None:
        """The stages' caches are gone (a re-plan): so is every entry. What was seen stays seen."""
        self.entries.clear()
        self._by_hash.clear()
        self._pending_by_hash.clear()
        self._drops.clear()
