"""The cluster-wide KV index: block hash -> replicas (instance, tier), pure bookkeeping.

No I/O, no clocks: every timestamp (`now`) comes from the caller, so the index can be
rebuilt deterministically by replaying the KV event stream.

Prefix matching is the hot path (the conductor asks it for every request), so each
(instance, tier) pair and each instance gets a bit, and every block keeps an int mask of
its holders. Matching a chain is then one dict lookup and one AND per block, and it stops
at the first block no remaining candidate holds: well under a millisecond for 256 blocks
over 64 instances, whatever the number of replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Literal, NewType, Sequence, cast, get_args

from shared.hashing import BlockHash

InstanceId = NewType("InstanceId", str)
Tier = Literal["dram", "disk"]
TIERS: tuple[Tier, ...] = get_args(Tier)


@dataclass(frozen=True, slots=True)
class Replica:
    instance_id: InstanceId
    tier: Tier


@dataclass(slots=True)
class BlockMeta:
    """What the index knows about one block, whoever holds it."""

    nbytes: int
    last_access: float
    hit_count: int = 0
    parent: BlockHash | None = None
    # Bit i set = the pair (or instance) owning bit i holds a replica.
    slot_mask: int = 0
    instance_mask: int = 0


@dataclass(frozen=True, slots=True)
class TierUsage:
    num_blocks: int
    nbytes: int


@dataclass(slots=True)
class _Slot:
    """One (instance, tier) pair: its bit and the blocks it holds (hash -> nbytes added)."""

    replica: Replica
    bit: int
    blocks: dict[BlockHash, int] = field(default_factory=dict)
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Leading blocks held, per (instance, tier) and per instance (any mix of its tiers)."""

    per_tier: dict[InstanceId, dict[Tier, int]]
    per_instance: dict[InstanceId, int]

    def best(self) -> tuple[InstanceId | None, int]:
        """Longest instance match; ties go to the longer DRAM match, then the smaller id."""
        if not self.per_instance:
            return None, 0
        inst = min(
            self.per_instance,
            key=lambda i: (-self.per_instance[i], -self.per_tier.get(i, {}).get("dram", 0), i),
        )
        return inst, self.per_instance[inst]


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _check_tier(tier: str) -> Tier:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}")
    return tier


class _BitAllocator:
    """Small ints for bit positions, reused after release so masks stay narrow."""

    def __init__(self) -> None:
        self._free: list[int] = []
        self._next = 0

    def take(self) -> int:
        if self._free:
            return self._free.pop()
        self._next += 1
        return self._next - 1

    def give(self, bit: int) -> None:
        self._free.append(bit)


class KVIndex:
    """Global index of cached KV blocks. Events are idempotent (a replayed stream is safe)."""

    def __init__(self) -> None:
        self._blocks: dict[BlockHash, BlockMeta] = {}
        self._slots: dict[tuple[InstanceId, Tier], _Slot] = {}
        self._slot_by_bit: dict[int, _Slot] = {}
        self._inst_bit: dict[InstanceId, int] = {}
        self._inst_by_bit: dict[int, InstanceId] = {}
        self._slot_bits = _BitAllocator()
        self._inst_bits = _BitAllocator()

    # ---- events -------------------------------------------------------------------------

    def stored(
        self,
        instance: str,
        tier: str,
        hashes: Sequence[int],
        nbytes_each: int,
        now: float,
        parent_of: int | None = None,
    ) -> int:
        """`instance` now holds `hashes` in `tier`. `hashes` is one contiguous chain segment:
        block i's parent is block i-1, block 0's is `parent_of`. Returns how many were new."""
        if nbytes_each < 0:
            raise ValueError(f"nbytes_each must be >= 0, got {nbytes_each}")
        slot = self._slot(InstanceId(instance), _check_tier(tier))
        inst_bit = 1 << self._inst_bit[slot.replica.instance_id]
        bit = 1 << slot.bit
        parent = None if parent_of is None else BlockHash(parent_of)
        num_new = 0
        for h in hashes:
            h = BlockHash(h)
            meta = self._blocks.get(h)
            if meta is None:
                meta = BlockMeta(nbytes=nbytes_each, last_access=now, parent=parent)
                self._blocks[h] = meta
            else:
                meta.last_access = max(meta.last_access, now)
                if meta.parent is None:
                    meta.parent = parent
            if h not in slot.blocks:
                slot.blocks[h] = nbytes_each
                slot.nbytes += nbytes_each
                meta.slot_mask |= bit
                meta.instance_mask |= inst_bit
                num_new += 1
            parent = h
        return num_new

    def removed(self, instance: str, tier: str, hashes: Iterable[int]) -> int:
        """`instance` dropped `hashes` from `tier`. Unknown blocks are ignored because
        the event stream is at-least-once. Returns how many were actually removed."""
        slot = self._slots.get((InstanceId(instance), _check_tier(tier)))
        if slot is None:
            return 0
        num_removed = 0
        for h in hashes:
            nbytes = slot.blocks.pop(BlockHash(h), None)
            if nbytes is None:
                continue
            slot.nbytes -= nbytes
            self._drop_replica(BlockHash(h), slot)
            num_removed += 1
        self._maybe_forget(slot.replica.instance_id)
        return num_removed

    def cleared(self, instance: str) -> int:
        """`instance` lost everything (restart, crash). Returns how many replicas went."""
        num_removed = 0
        for tier in TIERS:
            slot = self._slots.get((InstanceId(instance), tier))
            if slot is not None:
                num_removed += self.removed(instance, tier, list(slot.blocks))
        return num_removed

    def touch(self, hashes: Iterable[int], now: float) -> int:
        """Record a hit on each cached block of `hashes`. Returns how many were cached."""
        num_hit = 0
        for h in hashes:
            meta = self._blocks.get(BlockHash(h))
            if meta is not None:
                meta.last_access = max(meta.last_access, now)
                meta.hit_count += 1
                num_hit += 1
        return num_hit

    # ---- queries ------------------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> PrefixMatch:
        """One walk down the chain, narrowing the candidate masks until none is left."""
        per_slot, per_inst = self._walk(hashes)
        per_tier: dict[InstanceId, dict[Tier, int]] = {}
        for bit, n in per_slot.items():
            replica = self._slot_by_bit[bit].replica
            per_tier.setdefault(replica.instance_id, {})[replica.tier] = n
        per_instance = {self._inst_by_bit[bit]: n for bit, n in per_inst.items()}
        return PrefixMatch(per_tier=per_tier, per_instance=per_instance)

    def prefix_match(self, hashes: Sequence[int]) -> dict[InstanceId, dict[Tier, int]]:
        """Leading blocks of `hashes` held entirely in one tier, per instance and tier.
        Pairs that hold no leading block are absent."""
        return self.match(hashes).per_tier

    def best_prefix(self, hashes: Sequence[int]) -> tuple[InstanceId | None, int]:
        """The instance holding the longest prefix (tiers mixed), and its length in blocks."""
        return self.match(hashes).best()

    def replicas(self, block: int) -> list[Replica]:
        meta = self._blocks.get(BlockHash(block))
        if meta is None:
            return []
        return sorted(
            (self._slot_by_bit[b].replica for b in _bits(meta.slot_mask)),
            key=lambda r: (r.instance_id, r.tier),
        )

    def meta(self, block: int) -> BlockMeta | None:
        return self._blocks.get(BlockHash(block))

    def usage(self, instance: str, tier: str) -> TierUsage:
        slot = self._slots.get((InstanceId(instance), _check_tier(tier)))
        if slot is None:
            return TierUsage(num_blocks=0, nbytes=0)
        return TierUsage(num_blocks=len(slot.blocks), nbytes=slot.nbytes)

    def blocks_of(self, instance: str, tier: str) -> list[BlockHash]:
        slot = self._slots.get((InstanceId(instance), _check_tier(tier)))
        return [] if slot is None else list(slot.blocks)

    def instances(self) -> list[InstanceId]:
        return sorted(self._inst_bit)

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def __len__(self) -> int:
        """Distinct blocks cached anywhere."""
        return len(self._blocks)

    def check_invariants(self) -> None:
        """Masks, slot contents and byte counts agree. Raises RuntimeError if not."""
        for (inst, tier), slot in self._slots.items():
            if slot.nbytes != sum(slot.blocks.values()):
                raise RuntimeError(f"byte count drifted for {inst}/{tier}")
            for h in slot.blocks:
                meta = self._blocks.get(h)
                if meta is None or not meta.slot_mask >> slot.bit & 1:
                    raise RuntimeError(f"block {h} held by {inst}/{tier} but not indexed")
        for h, meta in self._blocks.items():
            if meta.slot_mask == 0:
                raise RuntimeError(f"block {h} indexed with no replica")
            for bit in _bits(meta.slot_mask):
                if h not in self._slot_by_bit[bit].blocks:
                    raise RuntimeError(f"block {h} mask names a pair that does not hold it")

    # ---- internals ----------------------------------------------------------------------

    def _walk(self, hashes: Sequence[int]) -> tuple[dict[int, int], dict[int, int]]:
        """Leading-match length per slot bit and per instance bit."""
        per_slot: dict[int, int] = {}
        per_inst: dict[int, int] = {}
        if not hashes:
            return per_slot, per_inst
        # A BlockHash is an int at run time: the hot loop looks raw hashes up unwrapped.
        blocks = cast("dict[int, BlockMeta]", self._blocks)
        first = blocks.get(hashes[0])
        if first is None:
            return per_slot, per_inst
        alive_slots, alive_insts = first.slot_mask, first.instance_mask
        for i, h in enumerate(hashes):
            meta = blocks.get(h)
            slots, insts = (meta.slot_mask, meta.instance_mask) if meta else (0, 0)
            if alive_slots & ~slots:
                for bit in _bits(alive_slots & ~slots):
                    per_slot[bit] = i
                alive_slots &= slots
            if alive_insts & ~insts:
                for bit in _bits(alive_insts & ~insts):
                    per_inst[bit] = i
                alive_insts &= insts
                if not alive_insts:  # alive slots are a subset: nothing left to match
                    return per_slot, per_inst
        for bit in _bits(alive_slots):
            per_slot[bit] = len(hashes)
        for bit in _bits(alive_insts):
            per_inst[bit] = len(hashes)
        return per_slot, per_inst

    def _slot(self, instance: InstanceId, tier: Tier) -> _Slot:
        slot = self._slots.get((instance, tier))
        if slot is None:
            if instance not in self._inst_bit:
                bit = self._inst_bits.take()
                self._inst_bit[instance] = bit
                self._inst_by_bit[bit] = instance
            slot = _Slot(replica=Replica(instance, tier), bit=self._slot_bits.take())
            self._slots[(instance, tier)] = slot
            self._slot_by_bit[slot.bit] = slot
        return slot

    def _drop_replica(self, h: BlockHash, slot: _Slot) -> None:
        meta = self._blocks[h]
        meta.slot_mask &= ~(1 << slot.bit)
        inst = slot.replica.instance_id
        other_tiers = [self._slots.get((inst, t)) for t in TIERS if t != slot.replica.tier]
        if not any(s is not None and h in s.blocks for s in other_tiers):
            meta.instance_mask &= ~(1 << self._inst_bit[inst])
        if meta.slot_mask == 0:
            del self._blocks[h]

    def _maybe_forget(self, instance: InstanceId) -> None:
        """Release an instance's bits once it holds nothing, so a churn of instance ids
        (every restart gets a new one) does not widen every mask forever."""
        slots = [self._slots.get((instance, t)) for t in TIERS]
        if any(s is not None and s.blocks for s in slots):
            return
        for s in slots:
            if s is not None:
                del self._slots[(instance, s.replica.tier)]
                del self._slot_by_bit[s.bit]
                self._slot_bits.give(s.bit)
        bit = self._inst_bit.pop(instance)
        del self._inst_by_bit[bit]
        self._inst_bits.give(bit)
