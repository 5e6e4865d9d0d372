"""CPU sets for pinning engine instances (pure): the kernel's list syntax ("0-3,8"), and
which cores each of `halfmoon up`'s engines gets when they are pinned."""

from __future__ import annotations


def parse_cpus(spec: str) -> set[int]:
    """CPUs named as the kernel lists them: "0", "0-3", "0-1,4" (ValueError otherwise)."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"CPU list {spec!r}: {part!r} is not a CPU or a range a-b")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"CPU list {spec!r}: range {part!r} runs backwards")
        cpus.update(range(lo, hi + 1))
    return cpus


def engine_cpus(index: int, threads: int, cpus: list[int]) -> str:
    """The cores of engine `index` (in start order) when each gets `threads` of `cpus`,
    round-robin: with more engines than cores they share, never more than they must."""
    picked = sorted({cpus[(index * threads + k) % len(cpus)] for k in range(threads)})
    return ",".join(str(c) for c in picked)
