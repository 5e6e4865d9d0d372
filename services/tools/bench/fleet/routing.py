"""Where a fleet's router sends each request: pure bookkeeping, no I/O.

Two policies, the ones a fleet of ordinary servers is run with:
- round robin: server i, then i + 1, whatever the prompt;
- prefix affinity, as llm-d's endpoint picker scores it by default: an approximate prefix
  scorer (the share of the prompt's leading blocks the router last sent to that server,
  remembered per server with LRU eviction) weighted 3, and a queue scorer (fewest
  requests in flight, scaled from 0 to 1 between the busiest and the idlest) weighted 2;
  the highest total wins, a tie drawn at random (seeded). The router cannot see a
  server's cache, so the index is what it sent where: "approximate".

Blocks are the prompt text's 64-character pieces, hashed as a chain by shared.hashing
(a block's hash covers every block before it, so equal hashes mean equal prefixes).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Protocol

from shared.hashing import block_hashes

BLOCK_CHARS = 64
MAX_BLOCKS = 256  # blocks of a prompt matched at most (its first 16k characters)
INDEX_BLOCKS = 31_250  # remembered per server
PREFIX_WEIGHT, QUEUE_WEIGHT = 3.0, 2.0
ROUTES = ("round_robin", "prefix")


def prefix_blocks(text: str, block_chars: int = BLOCK_CHARS) -> list[int]:
    """Chained hashes of the text's full blocks (a trailing partial block is left out): the
    KV cache's own chained hash (shared.hashing), over the characters' code points."""
    return list(block_hashes([ord(c) for c in text[: MAX_BLOCKS * block_chars]], block_chars))


class Route(Protocol):
    def pick(self, text: str, in_flight: list[int]) -> int:
        """The server for a request with this prompt text, given each one's load."""
        ...


class RoundRobin:
    def __init__(self, servers: int) -> None:
        self.servers, self._next = servers, 0

    def pick(self, text: str, in_flight: list[int]) -> int:
        i = self._next
        self._next = (i + 1) % self.servers
        return i


class PrefixAffinity:
    def __init__(self, servers: int, capacity: int = INDEX_BLOCKS, seed: int = 0) -> None:
        self.capacity = capacity
        self._rng = random.Random(seed)
        self._sent: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(servers)]

    def matched(self, server: int, blocks: list[int]) -> int:
        """How many of the leading blocks were last sent to `server`."""
        sent, n = self._sent[server], 0
        while n < len(blocks) and blocks[n] in sent:
            n += 1
        return n

    def scores(self, blocks: list[int], in_flight: list[int]) -> list[float]:
        most, least = max(in_flight), min(in_flight)
        out = []
        for i, load in enumerate(in_flight):
            prefix = self.matched(i, blocks) / len(blocks) if blocks else 0.0
            queue = (most - load) / (most - least) if most > least else 1.0
            out.append(PREFIX_WEIGHT * prefix + QUEUE_WEIGHT * queue)
        return out

    def pick(self, text: str, in_flight: list[int]) -> int:
        blocks = prefix_blocks(text)
        scores = self.scores(blocks, in_flight)
        top = max(scores)
        best = self._rng.choice([i for i, x in enumerate(scores) if x == top])
        self._remember(best, blocks)
        return best

    def _remember(self, server: int, blocks: list[int]) -> None:
        sent = self._sent[server]
        for h in blocks:
            sent[h] = None
            sent.move_to_end(h)
        while len(sent) > self.capacity:
            sent.popitem(last=False)


def make_route(name: str, servers: int) -> Route:
    if name == "round_robin":
        return RoundRobin(servers)
    if name == "prefix":
        return PrefixAffinity(servers)
    raise ValueError(f"route {name!r}: expected one of {', '.join(ROUTES)}")


def prompt_text(body: object) -> str:
    """What the router hashes: a chat request's messages in order (role and text), or a
    completion's prompt; the same conversation so far gives the same leading text."""
    if not isinstance(body, dict):
        return ""
    if isinstance(body.get("messages"), list):
        parts = []
        for m in body["messages"]:
            if isinstance(m, dict):
                parts.append(f"<{m.get('role', '')}>{_content(m.get('content'))}")
        return "".join(parts)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def _content(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""
