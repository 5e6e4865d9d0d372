"""The optional disk tier of an instance's KV store: evicted blocks spill to local files
and come back on a prefix hit, instead of being recomputed.

One file per block, named by its chained hash, holding the block's tokens (to verify a
hit, as the DRAM tier does) and its K/V bytes in the pool layout. LRU by bytes.
`DiskLink` is the engine's side: what the pool evicts spills here, and a prompt's prefix
found only here comes back into the pool before the prompt is scheduled.
"""

from __future__ import annotations

import logging
import os
import struct
from collections import OrderedDict
from pathlib import Path

import torch

from shared.engine.block_manager import BlockManager
from shared.engine.kv_cache import KVCache
from shared.engine.params import SamplingParams
from shared.engine.sequence import Sequence
from shared.hashing import block_hashes

log = logging.getLogger(__name__)
_HEADER = struct.Struct("<4sII")  # magic, number of tokens, K bytes
MAGIC = b"HMB1"


class DiskTier:
    def __init__(self, directory: Path, capacity_bytes: int) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob("*.kvb"):  # a previous incarnation's blocks: not indexed
            stale.unlink()
        self.capacity_bytes = capacity_bytes
        self._files: OrderedDict[int, int] = OrderedDict()  # hash -> bytes, LRU first
        self.nbytes = 0
        self._removed: list[int] = []

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._files

    def __len__(self) -> int:
        """Blocks on disk."""
        return len(self._files)

    def _path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}.kvb"

    def put(
        self, block_hash: int, tokens: tuple[int, ...], k: torch.Tensor, v: torch.Tensor
    ) -> bool:
        """Store one block (k, v: that block's slices, all layers). False if it cannot fit."""
        kb = k.contiguous().view(torch.uint8).numpy().tobytes()
        vb = v.contiguous().view(torch.uint8).numpy().tobytes()
        data = _HEADER.pack(MAGIC, len(tokens), len(kb)) + struct.pack(f"<{len(tokens)}I", *tokens)
        size = len(data) + len(kb) + len(vb)
        if size > self.capacity_bytes:
            return False
        while self.nbytes + size > self.capacity_bytes:
            self._drop_oldest()
        tmp = self._path(block_hash).with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.write(kb)
            f.write(vb)
        os.replace(tmp, self._path(block_hash))  # never a half-written block under its name
        self._files[block_hash] = size
        self.nbytes += size
        return True

    def get(
        self, block_hash: int, k_like: torch.Tensor, v_like: torch.Tensor
    ) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None:
        """(tokens, k, v) shaped like the given templates, or None if missing or corrupt."""
        try:
            raw = self._path(block_hash).read_bytes()
            magic, n_tokens, k_len = _HEADER.unpack_from(raw)
            if magic != MAGIC:
                raise ValueError("bad magic")
            off = _HEADER.size + 4 * n_tokens
            tokens = struct.unpack_from(f"<{n_tokens}I", raw, _HEADER.size)
            k = torch.frombuffer(bytearray(raw[off : off + k_len]), dtype=torch.uint8)
            v = torch.frombuffer(bytearray(raw[off + k_len :]), dtype=torch.uint8)
            k = k.view(k_like.dtype).view(k_like.shape)
            v = v.view(v_like.dtype).view(v_like.shape)
        except (OSError, ValueError, RuntimeError, struct.error) as exc:
            log.warning("disk block %016x unreadable (%s): dropped", block_hash, exc)
            self.remove(block_hash)
            return None
        self._files.move_to_end(block_hash)
        return tokens, k, v

    def remove(self, block_hash: int) -> None:
        size = self._files.pop(block_hash, None)
        if size is not None:
            self.nbytes -= size
            self._removed.append(block_hash)
            self._path(block_hash).unlink(missing_ok=True)

    def _drop_oldest(self) -> None:
        self.remove(next(iter(self._files)))

    def drain_removed(self) -> list[int]:
        out, self._removed = self._removed, []
        return out


class DiskLink:
    """The engine's pool and its disk tier (None: no tier, and every call is a no-op).
    Callers hold the engine's bookkeeping lock (see llm_engine.py)."""

    def __init__(self, disk: DiskTier | None, kv: KVCache, blocks: BlockManager) -> None:
        self.disk, self.kv, self.blocks = disk, kv, blocks
        self._stored: list[int] = []
        # Why the last load() stopped short of the blocks the disk tier listed ("" if it
        # did not): an unreadable file, or one whose tokens are not the prompt's.
        self.fault = ""
        if disk is not None:
            blocks.keep_spills = True

    def spill(self) -> None:
        """What the pool evicted goes to disk, before new KV overwrites it."""
        if self.disk is None:
            return
        for block_hash, block_id, tokens in self.blocks.take_spills():
            k, v = self.kv.block_data(block_id)
            if self.disk.put(block_hash, tokens, k, v):
                self._stored.append(block_hash)

    def drain_stored(self) -> list[int]:
        """Hashes of the blocks stored on disk since the last call."""
        out, self._stored = self._stored, []
        return out

    def drain_removed(self) -> list[int]:
        """Hashes of the blocks dropped from disk since the last call."""
        return self.disk.drain_removed() if self.disk else []

    def load(self, seq: Sequence) -> int:
        """Bring the prompt's prefix blocks that only the disk tier has back into the pool;
        returns the tokens they cover (`fault` says why when a listed block failed)."""
        self.fault = ""
        if self.disk is None:
            return 0
        bs = self.blocks.block_size
        hashes: list[int] = list(
            block_hashes(seq.token_ids[: (seq.num_tokens - 1) // bs * bs], bs, seq.salt)
        )
        n_dram = len(self.blocks.cached_chain(hashes))
        on_disk = 0
        while n_dram + on_disk < len(hashes) and hashes[n_dram + on_disk] in self.disk:
            on_disk += 1
        if not on_disk:
            return 0
        n_total = n_dram + on_disk
        tmp = Sequence(
            "disk-load",
            seq.token_ids[: n_total * bs] + [0],
            n_total * bs + 1,
            SamplingParams(max_tokens=1),
            seq.salt,
        )
        loaded = 0
        if self.blocks.match_prefix(tmp) == n_dram * bs and self.blocks.allocate(tmp, on_disk * bs):
            self.spill()
            loaded = self._read_blocks(self.disk, tmp, hashes, n_dram, on_disk)
            tmp.num_computed_tokens = (n_dram + loaded) * bs
            self.blocks.commit(tmp)
        self.blocks.free(tmp)
        return loaded * bs

    def _read_blocks(
        self, disk: DiskTier, tmp: Sequence, hashes: list[int], start: int, count: int
    ) -> int:
        bs, loaded = self.blocks.block_size, 0
        k_like, v_like = self.kv.k[:, 0], self.kv.v[:, 0]
        for i in range(start, start + count):
            got = disk.get(hashes[i], k_like, v_like)
            if got is None or got[0] != tuple(tmp.token_ids[i * bs : (i + 1) * bs]):
                why = "unreadable" if got is None else "not this prompt's tokens"
                self.fault = f"disk tier block {i} of the prompt is {why}"
                break
            self.kv.write_block(tmp.block_table[i], got[1], got[2])
            loaded += 1
        return loaded
