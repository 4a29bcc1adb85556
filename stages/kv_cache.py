"""Per-slot KV cache of a stage's own layers, and the per-group view the layers write through.

One arena per held layer, shaped [slots, kv_heads, capacity, head_dim]. A slot is one sequence's
place; the broker keeps the slots of a micro-batch adjacent, so in steady decode a micro-batch's
keys are a plain slice of the arena (no copy; at a job's tail a sequence moved to another micro-batch
reads as a run of its own). Capacity grows by doubling and shrinks again when the long sequences are
gone, so memory follows the longest live sequence, not the worst case. Where the broker knows the
job's longest sequence (the assignment's context_hint), the arena starts that long: growing a large
arena mid-job allocates, zeroes and copies every layer while the whole chain waits for that step.

A stage that sends on to another also keeps what it sent (its output hidden states, one vector per
slot-position): after a re-plan moves the layers behind it, it runs the moved layers from them instead
of recomputing its own (see `carry_from` and broker.replay_window).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layerbus.stages.packing import PackedLayout


@dataclass(frozen=True)
class CacheGroup:
    """Rows that run through the layers together: several decoding slots, or prefill chunks padded
    on the right to one length (their padding positions are computed, written past the row's end
    where nothing reads them before the row's next step overwrites them, and thrown away)."""

    slots: list[int]  # slot of each row
    starts: list[int]  # position of each row's first new token (= its cached length before this step)
    length: int  # positions per row (1 for decode; the longest chunk for prefill rows)
    real_lengths: list[int] | None = None  # each row's own new tokens when shorter than `length` (None: all equal)

    @property
    def ends(self) -> list[int]:
        """Where each row's positions end, padding included: what the cache must have room for."""
        return [start + self.length for start in self.starts]

    @property
    def filled_ends(self) -> list[int]:
        """Each row's cached length after this step: its real tokens only."""
        if self.real_lengths is None:
            return self.ends
        return [start + length for start, length in zip(self.starts, self.real_lengths)]


KV_INITIAL_CAPACITY = 128  # positions per slot an arena starts with when nothing says how long sequences get


class KVArena:
    """Keys and values for every slot of every held layer."""

    def __init__(self, layer_indices: list[int], num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, max_context: int,
                 initial_capacity: int = KV_INITIAL_CAPACITY, outputs_size: int = 0, allocate: bool = True):
        self.layer_slot = {layer: i for i, layer in enumerate(layer_indices)}
        self.num_slots = num_slots
        self.shape_tail = (num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.max_context = max_context
        self.initial_capacity = min(initial_capacity, max_context)
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths = [0] * num_slots  # cached tokens per slot
        # What this stage sent on, per slot-position [slots, capacity, outputs_size] (0: kept nowhere,
        # the last stage), and the layer those hidden states enter: the span's end when they were written.
        self.outputs_size = outputs_size
        self.outputs: torch.Tensor | None = None
        self.outputs_at: int | None = None
        # The layer the outputs carried over the last re-plan enter: a replay starts from those (each slot's
        # positions are rewritten at the new span's end as the replay passes them).
        self.carried_outputs_at: int | None = None
        # Positions carried over a re-plan, per slot: kept (not shrunk away) until the slot is released,
        # although a replay rewinds the slot's length below them while it rebuilds the moved layers.
        self.carried = [0] * num_slots
        # Prefix entries (broker/prefix_cache.py): entry -> (keys, values) per held layer, each
        # [kv_heads, length, head_dim]. The broker decides what is kept and bounds it.
        self.prefixes: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.prefix_tokens = 0  # positions the entries hold
        self.prefix_tokens_peak = 0  # the most they ever held at once (the broker's budget bounds it)
        self.prefix_bytes = 0  # their memory (keys and values of every held layer)
        if allocate:  # else carry_from, or allocate(), makes the tensors
            self.allocate()

    def allocate(self) -> None:
        self._resize(self.initial_capacity)

    def bytes_used(self) -> int:
        """The arena's memory: every slot's keys and values, and the hidden states it keeps of what it sent."""
        kept = [self.outputs] if self.outputs is not None else []
        return sum(t.numel() * t.element_size() for t in self.keys + self.values + kept)

    def save_prefix(self, entry: int, slot: int, length: int) -> None:
        """Keep a copy of the slot's first `length` positions as `entry`."""
        if length > self.lengths[slot]:
            raise ValueError(f"prefix save of {length} positions from slot {slot}, which holds {self.lengths[slot]}")
        self.drop_prefixes([entry])  # a resent step saves again: replace, do not count twice
        with torch.inference_mode():
            keys = [k[slot, :, :length].clone() for k in self.keys]
            values = [v[slot, :, :length].clone() for v in self.values]
            if self.outputs is not None:  # kept beside the layers' keys, as the replay after a re-plan needs them
                keys.append(self.outputs[slot, :length].clone())
        self.prefixes[entry] = (keys, values)
        # Totals kept as plain ints: the heartbeat thread reports them while this thread changes the dict.
        self.prefix_tokens += length
        self.prefix_tokens_peak = max(self.prefix_tokens_peak, self.prefix_tokens)
        self.prefix_bytes += sum(t.numel() * t.element_size() for t in keys + values)

    def restore_prefix(self, entry: int, slot: int, length: int) -> None:
        """Fill the slot's first `length` positions from `entry` (the slot's sequence starts there)."""
        saved = self.prefixes.get(entry)
        if saved is None:
            raise ValueError(f"prefix entry {entry} is not held here (this stage restarted, or a save was lost): "
                             "the broker computes the prefix instead")
        keys, values = saved
        if self.outputs is not None:
            keys, outputs = keys[:len(values)], keys[len(values)]
        if not keys or keys[0].shape[1] < length:
            raise ValueError(f"prefix entry {entry} holds {keys[0].shape[1] if keys else 0} positions, "
                             f"{length} asked for")
        self.prepare_rows([slot], [0], [length])
        with torch.inference_mode():  # the arena's tensors are inference tensors (made under run_step's mode)
            for i in range(len(self.keys)):
                self.keys[i][slot, :, :length] = keys[i][:, :length]
                self.values[i][slot, :, :length] = values[i][:, :length]
            if self.outputs is not None:
                self.outputs[slot, :length] = outputs[:length]
        self.lengths[slot] = length

    def drop_prefixes(self, entries: list[int]) -> None:
        for entry in entries:
            saved = self.prefixes.pop(entry, None)  # one never saved here (its step failed before): nothing to free
            if saved is not None:
                keys, values = saved
                self.prefix_tokens -= values[0].shape[1] if values else 0
                self.prefix_bytes -= sum(t.numel() * t.element_size() for t in keys + values)

    def prepare(self, group: CacheGroup) -> None:
        """Make room for the group and forget anything cached past each row's start."""
        self.prepare_rows(group.slots, group.starts, group.ends)

    def prepare_rows(self, slots: list[int], starts: list[int], ends: list[int]) -> None:
        """Make room for positions up to each row's end and forget anything cached past its start."""
        needed = max(ends)
        if needed > self.max_context:
            raise ValueError(f"position {needed} exceeds the context budget of {self.max_context} tokens")
        for slot, start in zip(slots, starts):
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"slot {slot} is outside this stage's {self.num_slots} slots")
            if start > self.lengths[slot]:
                raise ValueError(f"slot {slot}: step starts at position {start} but only "
                                 f"{self.lengths[slot]} tokens are cached (a step was lost)")
            # A start below the cached length rewinds the slot (a new sequence starts at 0, and a
            # recovery re-prefills from an earlier point); stale keys past it are masked out.
            self.lengths[slot] = start
        if needed > self.capacity:
            capacity = self.capacity
            while capacity < needed:
                capacity *= 2
            self._resize(min(capacity, self.max_context))

    def commit(self, group: CacheGroup) -> None:
        self.commit_rows(group.slots, group.filled_ends)

    def commit_rows(self, slots: list[int], ends: list[int]) -> None:
        for slot, end in zip(slots, ends):
            self.lengths[slot] = end

    def release(self, slot: int) -> None:
        """Forget a finished sequence; give memory back once the remaining ones are much shorter."""
        self.lengths[slot] = 0
        self.carried[slot] = 0
        longest = max(max(self.lengths), max(self.carried))
        if self.capacity > self.initial_capacity and longest * 4 <= self.capacity:
            self._resize(max(self.initial_capacity, _next_power_of_two(max(longest, 1)) * 2))

    def view(self, group: CacheGroup, in_place: bool = False) -> "StepCache":
        return StepCache(self, group, in_place)

    def packed_view(self, layout: "PackedLayout") -> "PackedCache":
        return PackedCache(self, layout)

    def _resize(self, capacity: int) -> None:
        keep = min(capacity, self.capacity)
        new_keys, new_values = [], []
        for i in range(len(self.layer_slot)):
            # Zeros, not empty(): masked positions still enter the attention product, and 0 * NaN
            # from uninitialized memory would poison real rows.
            k = torch.zeros((self.num_slots, self.shape_tail[0], capacity, self.shape_tail[1]),
                            dtype=self.dtype, device=self.device)
            v = torch.zeros_like(k)
            if keep:
                k[:, :, :keep] = self.keys[i][:, :, :keep]
                v[:, :, :keep] = self.values[i][:, :, :keep]
            new_keys.append(k)
            new_values.append(v)
        if self.outputs_size:
            outputs = torch.zeros((self.num_slots, capacity, self.outputs_size), dtype=self.dtype, device=self.device)
            if keep and self.outputs is not None:
                outputs[:, :keep] = self.outputs[:, :keep]
            self.outputs = outputs
        self.keys, self.values, self.capacity = new_keys, new_values, capacity

    # -- across a re-plan ---------------------------------------------------------------------
    def compatible(self, other: "KVArena") -> bool:
        """Whether `other`'s slots can carry into this arena: the same slots, heads, dtype and device."""
        return (other.num_slots == self.num_slots and other.shape_tail == self.shape_tail
                and other.dtype == self.dtype and other.device == self.device and other.max_context == self.max_context)

    def carry_from(self, old: "KVArena", layers: list[int], outputs_at: int | None) -> None:
        """Take over `old`'s keys and values of `layers` (held by both) for every slot, and its sent
        hidden states when they enter layer `outputs_at`; the tensors move, nothing is copied. Every
        slot keeps its length; the layers this arena holds anew are empty until the broker replays
        them (the prefix entries are not carried: the broker forgets them at a re-plan)."""
        with torch.inference_mode():  # the old arena's tensors may be inference tensors (made in a step)
            self._carry(old, layers, outputs_at)

    def _carry(self, old: "KVArena", layers: list[int], outputs_at: int | None) -> None:
        # Built at the larger capacity directly: growing first would fill every layer with zeros, the
        # kept ones too, and on a stage holding gigabytes of KV that doubles the memory for a moment.
        capacity = max(old.capacity, self.initial_capacity)
        kept = {self.layer_slot[layer]: old.layer_slot[layer] for layer in layers}
        shape = (self.num_slots, self.shape_tail[0], capacity, self.shape_tail[1])
        new_keys, new_values = [], []
        for i in range(len(self.layer_slot)):
            for theirs, made in ((old.keys, new_keys), (old.values, new_values)):
                made.append(_fitted(theirs[kept[i]], 2, capacity) if i in kept
                            else torch.zeros(shape, dtype=self.dtype, device=self.device))
        if outputs_at is not None and old.outputs is not None and self.outputs_size == old.outputs_size:
            self.outputs = _fitted(old.outputs, 1, capacity)
            self.outputs_at = self.carried_outputs_at = outputs_at
        elif self.outputs_size:
            self.outputs = torch.zeros((self.num_slots, capacity, self.outputs_size), dtype=self.dtype, device=self.device)
        self.keys, self.values, self.capacity = new_keys, new_values, capacity
        self.lengths = list(old.lengths)
        self.carried = list(old.lengths)

    def store_outputs(self, slots: list[int], starts: list[int], lengths: list[int], hidden: torch.Tensor,
                      end_layer: int) -> None:
        """Keep what this stage sends on: `hidden` [N, size] packed in row order, entering `end_layer`."""
        if self.outputs is None:
            return
        offset, single = 0, ([], [], [])  # one-position rows (decode) go in one scatter, not one copy each
        with torch.inference_mode():
            for slot, start, length in zip(slots, starts, lengths):
                if length == 1:
                    for part, value in zip(single, (slot, start, offset)):
                        part.append(value)
                else:
                    self.outputs[slot, start:start + length] = hidden[offset:offset + length]
                offset += length
            if single[0]:
                at = [torch.tensor(part, device=self.device) for part in single]
                self.outputs[at[0], at[1]] = hidden[at[2].to(hidden.device)]
        self.outputs_at = end_layer

    def stored_outputs(self, slots: list[int], starts: list[int], lengths: list[int]) -> torch.Tensor:
        """The kept hidden states of these rows' positions, packed in row order."""
        if self.outputs is None:
            raise ValueError("this stage keeps no hidden states to replay from (it was the last stage)")
        return torch.cat([self.outputs[slot, start:start + length] for slot, start, length in zip(slots, starts, lengths)])


def _fitted(tensor: torch.Tensor, positions_dim: int, capacity: int) -> torch.Tensor:
    """`tensor` itself when it holds `capacity` positions, else a zero-padded copy that does."""
    if tensor.shape[positions_dim] == capacity:
        return tensor
    shape = list(tensor.shape)
    shape[positions_dim] = capacity
    grown = torch.zeros(shape, dtype=tensor.dtype, device=tensor.device)
    grown.narrow(positions_dim, 0, tensor.shape[positions_dim]).copy_(tensor)
    return grown


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


class StepCache:
    """What a transformers attention module sees as its cache for one group: `update` writes the
    group's new keys/values into the arena and returns the keys/values the group attends over."""

    def __init__(self, arena: KVArena, group: CacheGroup, in_place: bool = False):
        # in_place: a decode group's update() returns the whole arenas; stages.attention slices
        # each row's own keys from them. Otherwise it returns padded keys for a masked kernel.
        self.arena, self.group, self.in_place = arena, group, in_place
        slots = group.slots
        self.key_length = max(group.ends)
        self.contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        self.slot_index = torch.tensor(slots, device=arena.device)
        if group.length == 1:
            self.position_index = torch.tensor(group.starts, device=arena.device)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        arena, group = self.arena, self.group
        i = arena.layer_slot[layer_idx]
        keys, values = arena.keys[i], arena.values[i]
        if group.length == 1:
            # key_states: [B, kv_heads, 1, head_dim] -> one position per row
            keys[self.slot_index, :, self.position_index] = key_states[:, :, 0]
            values[self.slot_index, :, self.position_index] = value_states[:, :, 0]
            if self.in_place:
                return keys, values
        else:
            for row, (slot, start) in enumerate(zip(group.slots, group.starts)):
                keys[slot, :, start:start + group.length] = key_states[row]
                values[slot, :, start:start + group.length] = value_states[row]
        if self.contiguous:
            first = group.slots[0]
            rows = slice(first, first + len(group.slots))
            return keys[rows, :, :self.key_length], values[rows, :, :self.key_length]
        return keys[self.slot_index, :, :self.key_length], values[self.slot_index, :, :self.key_length]


class PackedCache:
    """The cache a packed step's layers see (stages.packing): `update` writes every row's new
    keys/values into its slot and returns the layer's whole arenas, from which
    stages.attention reads each row's own keys in place."""

    def __init__(self, arena: KVArena, layout: PackedLayout):
        self.arena, self.layout = arena, layout

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states: [1, kv_heads, N, head_dim] in packed order.
        arena, layout = self.arena, self.layout
        i = arena.layer_slot[layer_idx]
        keys, values = arena.keys[i], arena.values[i]
        decode = layout.num_decode
        if decode:
            # One scatter for all decode rows: row r's key goes to (slot r, position r).
            keys[layout.decode_slots, :, layout.decode_positions] = key_states[0, :, :decode].transpose(0, 1)
            values[layout.decode_slots, :, layout.decode_positions] = value_states[0, :, :decode].transpose(0, 1)
        for chunk in layout.chunks:
            end = chunk.offset + chunk.length
            keys[chunk.slot, :, chunk.start:chunk.start + chunk.length] = key_states[0, :, chunk.offset:end]
            values[chunk.slot, :, chunk.start:chunk.start + chunk.length] = value_states[0, :, chunk.offset:end]
        return keys, values
