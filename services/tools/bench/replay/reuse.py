"""`halfmoon bench replay --compare decode-reuse` (issue 32): the same trace against 2P+1D
with decode-side prefix reuse and without it, one cluster after the other in one run.

With reuse, before a handoff's KV is offered, prefill asks the decode instance which
leading blocks of the prompt it caches already (the same conversation's earlier turn) and
sends only the rest. What moved is read from the decode instances' heartbeats (their
cumulative KV activity) before and after each run: the bytes per handoff, with and
without, and the share of the prompts' KV decode held. The drop in bytes should match
that share; TTFT, TBT and the outputs are in each run's summary beside them.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Any, Sequence

from services.tools.bench.replay import machine
from services.tools.bench.replay.cluster import ClusterConfig

# fp32: greedy answers are compared between the runs, and in bf16 the same prompt's KV
# computed in two chunkings (a turn's prefill, then the next turn's) may differ in its last
# bits, enough to flip a near-tie token (2 of 150 answers on the AVX-512 EPYC).
SHAPE = "--prefill 2 --decode 1 --policy kvcentric --dtype float32"
PRESET = (
    ClusterConfig.parse(f"reuse={SHAPE}"),
    ClusterConfig.parse(f"no_reuse={SHAPE} HALFMOON_DECODE_REUSE=false"),
)
TOLERANCE = 0.05  # the bar: the drop within 5 points of the share decode held


@dataclass(frozen=True)
class Handoffs:
    """The decode instances' handoff traffic (summed, cumulative or over a run)."""

    handoffs: int = 0
    nbytes: int = 0  # fetched
    held_bytes: int = 0  # held already, not fetched
    # and the prefill instances': hot prefixes copied in ahead of demand (replicas.py)
    replicas: int = 0
    replica_bytes: int = 0

    @classmethod
    def of(cls, state: dict[str, Any]) -> Handoffs:
        """From /admin/state: every engine's KV activity, added up."""
        total = cls()
        for info in state.get("instances", []):
            a = info.get("kv_activity", {})
            if info.get("role") == "decode":
                total = total + cls(
                    a.get("handoffs", 0), a.get("handoff_bytes", 0), a.get("handoff_held_bytes", 0)
                )
            elif info.get("role") == "prefill":
                copies = a.get("replicas", 0), a.get("replica_bytes", 0)
                total = total + cls(replicas=copies[0], replica_bytes=copies[1])
        return total

    def __add__(self, o: Handoffs) -> Handoffs:
        return Handoffs(*(a + b for a, b in zip(astuple(self), astuple(o))))

    def __sub__(self, o: Handoffs) -> Handoffs:
        return Handoffs(*(a - b for a, b in zip(astuple(self), astuple(o))))

    def per_handoff(self) -> float | None:
        return self.nbytes / self.handoffs if self.handoffs else None

    def held_share(self) -> float | None:
        """Of the handed-off prompts' KV, the share decode held already."""
        whole = self.nbytes + self.held_bytes
        return self.held_bytes / whole if whole else None

    def as_json(self) -> dict[str, Any]:
        return {
            "handoffs": self.handoffs,
            "bytes": self.nbytes,
            "held_bytes": self.held_bytes,
            "bytes_per_handoff": self.per_handoff(),
            "held_share": self.held_share(),
            "replicas": self.replicas,
            "replica_bytes": self.replica_bytes,
        }


async def handoffs_now(url: str) -> Handoffs:
    """Once every engine has sent a heartbeat after this call (so no handoff is missed)."""
    _, state = await machine.mark_after(url)
    return Handoffs.of(state)


def moved(name: str, before: Handoffs, after: Handoffs) -> dict[str, Any]:
    """What one run's handoffs moved, printed and for its report."""
    print(describe(name, after - before), flush=True)
    return (after - before).as_json()


def describe(name: str, moved: Handoffs) -> str:
    per, share = moved.per_handoff(), moved.held_share()
    copies = (
        f"; {moved.replicas} hot-prefix copies moved {moved.replica_bytes / 2**20:,.1f} MiB"
        if moved.replicas
        else ""
    )
    if per is None:
        return f"[{name}] no handoff was recorded{copies}"
    return (
        f"[{name}] {moved.handoffs} handoffs moved {moved.nbytes / 2**20:,.1f} MiB of KV "
        f"({per / 2**10:,.0f} KiB each); decode held {moved.held_bytes / 2**20:,.1f} MiB "
        f"more ({share:.1%} of the prompts' KV){copies}"
    )


def comparison(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bytes per handoff with reuse against without, and whether the drop matches the
    share decode held with the answers unchanged (the issue's acceptance line)."""
    by_name = {r["name"]: r for r in runs if "handoffs" in r}
    if "reuse" not in by_name or "no_reuse" not in by_name:
        return []
    on, off = by_name["reuse"]["handoffs"], by_name["no_reuse"]["handoffs"]
    if not (on["bytes_per_handoff"] and off["bytes_per_handoff"]) or on["held_share"] is None:
        return [{"what": "decode-side reuse", "met": False, "text": "decode reuse: no handoffs"}]
    same, both = same_answers(by_name["reuse"]["records"], by_name["no_reuse"]["records"])
    drop = 1.0 - on["bytes_per_handoff"] / off["bytes_per_handoff"]
    share = on["held_share"]
    ok = abs(drop - share) <= TOLERANCE and same == both
    text = (
        f"handoff bytes per request, reuse / no_reuse: {on['bytes_per_handoff'] / 2**10:,.0f} / "
        f"{off['bytes_per_handoff'] / 2**10:,.0f} KiB = {1 - drop:.2f}x, a drop of "
        f"{drop:.1%}; decode held {share:.1%} of the prompts' KV (target: within "
        f"{TOLERANCE * 100:.0f} points, every greedy answer the same: "
        f"{'met' if ok else 'NOT met'}); greedy answers the same in both runs: {same} of {both}"
    )
    verdict = {"what": "decode-side reuse", "drop": drop, "held_share": share, "met": ok}
    return [{**verdict, "same_answers": same, "compared": both, "text": text}]


def same_answers(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[int, int]:
    """(identical, compared): the answers of requests completed in both runs."""
    other = {r["index"]: r for r in b if r["status"] == "completed"}
    pairs = [
        (r, other[r["index"]]) for r in a if r["status"] == "completed" and r["index"] in other
    ]
    return sum(x["text"] == y["text"] for x, y in pairs), len(pairs)
