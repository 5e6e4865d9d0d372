"""The TCP data plane's frames (tcp.py has the exchange they make up):

receiver → sender   MAGIC | u16 id_len | transfer id
sender → receiver   MAGIC | u8 status | u32 meta_len | u64 payload_len | u64 xxh3 | meta
                    | zeros up to a multiple of 64 bytes | payload
receiver → sender   u8 ack (1: verified)
"""

from __future__ import annotations

import struct

from shared.transfer.base import TRANSFER_ID_BYTES, BadFrame

MAGIC = b"HMKV"
REQUEST = struct.Struct("<4sH")
HEADER = struct.Struct("<4sBIQQ")
STATUS_OK, STATUS_UNKNOWN = 0, 1
# Receive and send step: small enough that each piece is hashed while still in cache,
# large enough that the per-call overhead is noise (64 calls for 64 MiB).
CHUNK = 1 << 20
# The payload starts at a stream offset that is a multiple of this, so the kernel's copies
# (sender → socket buffer → receiver) run between equally aligned addresses: a 37-byte
# header before 64 MiB made loopback take 29 ms instead of 13 here.
ALIGN = 64
# The request (magic and id) must arrive this soon after connecting: a peer that connects
# and stays silent must not hold a task and a socket for ever.
REQUEST_TIMEOUT_S = 10.0
MAX_ID_LEN = 2 * TRANSFER_ID_BYTES  # hex; anything longer is refused unread
# A KV export's meta (block hashes, token count, layout) is kilobytes; a header that
# announces more is not one of ours, and is refused before anything is read or allocated.
MAX_META_BYTES = 16 << 20


def check_sizes(meta_len: int, payload_len: int, expected_payload: int) -> None:
    """Refuse a header whose sizes are not the offer's: the payload is exactly the
    handle's nbytes (the sender minted both), the meta within MAX_META_BYTES."""
    if meta_len > MAX_META_BYTES:
        raise BadFrame(f"meta of {meta_len} bytes announced (at most {MAX_META_BYTES})")
    if payload_len != expected_payload:
        raise BadFrame(
            f"payload of {payload_len} bytes announced, the offer has {expected_payload}"
        )


def padding(meta_len: int) -> int:
    """Zeros after the meta, so that the payload starts ALIGN-aligned in the stream."""
    return -(HEADER.size + meta_len) % ALIGN
