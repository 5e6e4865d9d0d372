"""`halfmoon bench transfer`: the KV data plane against a plain socket copy, one run.

A child process holds --mib MiB of random "blocks" and sends; this process receives and
times. Every round runs every mode once, in turn, so background load hits all alike; a
first round warms both processes up and is not counted.

- plain: the baseline. The child sends the bytes over loopback TCP in 1 MiB frames
  (asyncio sock_sendall per frame); we receive them with sock_recv_into into a new
  bytearray. Timed: connect → last byte in. No header, no checksum.
- plain_reused: the same into one buffer kept across rounds: no fresh pages to fault in
  (a 64 MiB bytearray costs ~35 ms of page faults on this VM, more than loopback does).
- tcp: TcpKVSender / TcpKVReceiver. Timed: the receiver's whole fetch() (connect, request,
  header, payload into a new bytearray, xxh3 verification, ack).
- tcp_reused: the same into the reused buffer, via TcpKVReceiver(allocate=...).
- shm: ShmKVSender / ShmKVReceiver (same host, so shared memory). Timed: the whole fetch()
  (control connection, map, xxh3 verification over all bytes, unlink, ack); the payload
  comes back as a view of the mapping, which needs no new pages.
- shm_copy: the same, copying the payload out into a new bytearray before the ack.

offer() runs in the child before each fetch and is timed there: it is the sender's part,
getting the payload into the buffer its transport sends from. For tcp that buffer is the
payload itself, so offer() only hashes it; for shm it writes the payload into a new segment
(a copy, into fresh tmpfs pages) and hashes it. The plain copy sends from the payload as it
is: it has no offer. Every ratio compares end-to-end figures, offer + fetch: the time from
"these bytes are to go" to "they are in, verified, on the other side", so the sender's copy
counts against the transport that needs it. The fetch figures alone (what the receiver waits
for once it has the handle) are in the table and the JSON, not in any ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import xxhash

from shared.messages import KVHandle
from shared.transfer.shm import ShmKVReceiver, ShmKVSender, segments
from shared.transfer.tcp import TcpKVReceiver, TcpKVSender, connect, recv_into_exact, tune_socket

MODES = ("plain", "plain_reused", "tcp", "tcp_reused", "shm", "shm_copy")
# name: (numerator mode, denominator mode, target or None); all of end_to_end_mib_s
Ratios = dict[str, tuple[str, str, float | None]]
RATIOS: Ratios = {
    "tcp_over_plain": ("tcp", "plain", 0.7),
    "tcp_reused_over_plain_reused": ("tcp_reused", "plain_reused", 0.7),
    "shm_over_tcp": ("shm", "tcp", 2.0),
    "shm_over_tcp_reused": ("shm", "tcp_reused", None),
    "shm_copy_over_tcp": ("shm_copy", "tcp", None),
}
RATIO_METRIC = "end_to_end_mib_s"


# --- the child: holds the payload and sends ---------------------------------------------


async def _serve_plain(payload: memoryview, frame: int, host: str) -> tuple[asyncio.Task, int]:
    """A bare server: one copy of the payload per connection, after a 1-byte request."""
    loop = asyncio.get_running_loop()
    listener = socket.create_server((host, 0))
    listener.setblocking(False)

    async def one(conn: socket.socket) -> None:
        with conn:
            await loop.sock_recv(conn, 1)
            for start in range(0, len(payload), frame):
                await loop.sock_sendall(conn, payload[start : start + frame])
            await loop.sock_recv(conn, 1)  # the receiver's "got it": close after, not before

    async def accept() -> None:
        tasks = set()
        while True:
            conn, _ = await loop.sock_accept(listener)
            tune_socket(conn)
            task = asyncio.create_task(one(conn))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    return asyncio.create_task(accept()), listener.getsockname()[1]


async def child(mib: int, frame: int, host: str) -> int:
    payload = memoryview(os.urandom(mib << 20))
    senders = {"tcp": TcpKVSender(host), "shm": ShmKVSender(host)}
    for s in senders.values():
        await s.start()
    plain_task, plain_port = await _serve_plain(payload, frame, host)
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    _say(
        {
            "host": host,
            "plain_port": plain_port,
            "xxh3": xxhash.xxh3_64_intdigest(payload),
            "pid": os.getpid(),
        }
    )
    while line := (await stdin.readline()).decode().strip():
        kind, tid = line.split()
        t0 = time.perf_counter()
        handle = senders[kind].offer(tid, b'{"bench": 1}', payload, num_tokens=0, ttl_s=60)
        _say({"handle": handle.model_dump(), "offer_s": time.perf_counter() - t0})
    plain_task.cancel()
    for s in senders.values():
        await s.close()
    _say({"leftover_segments": segments(os.getpid())})
    return 0


def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# --- the parent: receives and times -----------------------------------------------------


class Parent:
    def __init__(self, proc: asyncio.subprocess.Process, hello: dict, nbytes: int, frame: int):
        self.proc, self.hello, self.nbytes, self.frame = proc, hello, nbytes, frame
        self.reused = bytearray(nbytes)
        reused = self.reused
        self.receivers = {
            "tcp": TcpKVReceiver(),
            "shm": ShmKVReceiver(),
            "tcp_reused": TcpKVReceiver(allocate=lambda n: memoryview(reused)[:n]),
            "shm_copy": ShmKVReceiver(copy=True),
        }

    async def ask(self, line: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()
        return json.loads(await self.proc.stdout.readline())

    async def plain(self, reuse: bool) -> tuple[float, float, bytes | bytearray]:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        sock = await connect(self.hello["host"], self.hello["plain_port"])
        try:
            await loop.sock_sendall(sock, b"g")
            buf = self.reused if reuse else bytearray(self.nbytes)
            view = memoryview(buf)
            for start in range(0, self.nbytes, self.frame):
                await recv_into_exact(sock, view[start : start + self.frame])
            dt = time.perf_counter() - t0
            await loop.sock_sendall(sock, b"k")
        finally:
            sock.close()
        return 0.0, dt, buf

    async def transport(self, mode: str, tid: str) -> tuple[float, float, Any]:
        reply = await self.ask(f"{mode[:3]} {tid}")
        handle = KVHandle.model_validate(reply["handle"])
        if mode.startswith("shm") and handle.transport != "shm":
            raise RuntimeError("the shm sender fell back to TCP: is /dev/shm available?")
        t0 = time.perf_counter()
        _, payload = await self.receivers[mode].fetch(handle, timeout_s=60)
        return reply["offer_s"], time.perf_counter() - t0, payload

    async def once(self, mode: str, rnd: int) -> tuple[float, float]:
        if mode.startswith("plain"):
            offer_s, fetch_s, payload = await self.plain(reuse=mode == "plain_reused")
        else:
            offer_s, fetch_s, payload = await self.transport(mode, f"{mode}.{rnd}")
        if xxhash.xxh3_64_intdigest(payload) != self.hello["xxh3"]:  # outside the timing
            raise RuntimeError(f"{mode}: received bytes differ from the sent ones")
        return offer_s, fetch_s


def _summary(nbytes: int, offers: list[float], fetches: list[float]) -> dict[str, Any]:
    mib = nbytes / 2**20
    e2e = [o + f for o, f in zip(offers, fetches)]
    return {
        "fetch_ms": {"best": min(fetches) * 1e3, "median": statistics.median(fetches) * 1e3},
        "offer_ms": {"best": min(offers) * 1e3, "median": statistics.median(offers) * 1e3},
        "fetch_mib_s": {"best": mib / min(fetches), "median": mib / statistics.median(fetches)},
        "end_to_end_mib_s": {"best": mib / min(e2e), "median": mib / statistics.median(e2e)},
    }


def _ratios(res: dict[str, dict], ratios: Ratios) -> dict[str, dict]:
    """best/best and median/median, end to end; a target counts as met on the medians."""
    out = {}
    for name, (num, den, target) in ratios.items():
        r: dict[str, Any] = {
            k: res[num][RATIO_METRIC][k] / res[den][RATIO_METRIC][k] for k in ("best", "median")
        }
        r["of"] = f"{num} / {den}, {RATIO_METRIC} (offer + fetch)"
        if target is not None:
            r.update(target=target, met=r["median"] >= target)
        out[name] = r
    return out


@dataclass(frozen=True)
class Placement:
    """Where the two ends run: by default both here, over loopback. Across hosts
    (transfer_hosts.py), the sender runs under `launcher` and binds `host`."""

    modes: tuple[str, ...] = MODES
    ratios: Ratios = field(default_factory=lambda: dict(RATIOS))
    launcher: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    link: str = "loopback TCP / this host's /dev/shm"


# Across two hosts (transfer_hosts.py): TCP only, against the plain copy between them.
ACROSS_MODES = ("plain", "plain_reused", "tcp", "tcp_reused")
ACROSS_RATIOS: Ratios = {
    "tcp_over_plain": ("tcp", "plain", 0.8),
    "tcp_reused_over_plain_reused": ("tcp_reused", "plain_reused", 0.8),
}


def across(sender_netns: str, host: str) -> Placement:
    """The receiver runs here (already on its host); the sender on `sender_netns`."""
    return Placement(
        ACROSS_MODES,
        dict(ACROSS_RATIOS),
        ("ip", "netns", "exec", sender_netns),
        host,
        f"TCP between two hosts (network namespaces, veth pairs on a bridge); sender {host}",
    )


async def run(mib: int, rounds: int, frame: int, where: Placement | None = None) -> dict[str, Any]:
    where = where or Placement()
    modes = where.modes
    proc = await asyncio.create_subprocess_exec(
        *where.launcher,
        sys.executable,
        "-m",
        "services.tools.bench.transfer_bench",
        "--child",
        "--mib",
        str(mib),
        "--frame-kib",
        str(frame >> 10),
        "--bind",
        where.host,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )  # -m: the child imports what this process imports
    assert proc.stdout is not None and proc.stdin is not None
    try:
        parent = Parent(proc, json.loads(await proc.stdout.readline()), mib << 20, frame)
        times: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in modes}
        for rnd in range(rounds + 1):  # round 0 warms both processes up and is not counted
            for mode in modes:
                offer_s, fetch_s = await parent.once(mode, rnd)
                if rnd:
                    times[mode][0].append(offer_s)
                    times[mode][1].append(fetch_s)
        proc.stdin.close()
        leftover = json.loads(await proc.stdout.readline())["leftover_segments"]
    finally:
        if proc.returncode is None:
            proc.stdin.close()  # the child closes its senders and exits on EOF
            try:
                async with asyncio.timeout(30):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
    results = {m: _summary(mib << 20, *times[m]) for m in modes}
    return {
        "bench": "transfer",
        "mib": mib,
        "rounds": rounds,
        "frame_kib": frame >> 10,
        "setup": {
            "cpus": os.cpu_count(),
            "loadavg_at_start": os.getloadavg(),
            "sender": "child process",
            "receiver": "this process",
            "link": where.link,
            "warmup_rounds": 1,
        },
        "results": results,
        "ratios": _ratios(results, where.ratios),
        "included": dict(_INCLUDED),
        "leftover_shm_segments": leftover,
    }


_INCLUDED = {
    "plain": "connect + receiving all frames into a new bytearray; no header, no checksum",
    "plain_reused": "as plain, into one bytearray reused across rounds (no page faults)",
    "tcp": "fetch(): connect, request, header, payload into a new bytearray, xxh3 verify, ack",
    "tcp_reused": "as tcp, into the one reused buffer (TcpKVReceiver(allocate=...))",
    "shm": "fetch(): control connection, map segment, xxh3 verify, unlink, ack; returns a view",
    "shm_copy": "as shm, plus a copy into a new bytearray before the ack",
    "offer": "child side, before the fetch: xxh3 of the payload (+ shm: write the segment); "
    "plain has none (it sends from the payload as it is)",
    "end_to_end": "offer + fetch; every ratio is of these",
    "not timed": "freeing or unmapping the received payload afterwards, in every mode",
}


def _offer_cell(mode: str, o: dict[str, float]) -> str:
    """The plain copy has no sender-side step: a dash, not a 0.0 that reads as measured."""
    if mode.startswith("plain"):
        return f"{'-':>16}"
    return f"{o['best']:>8.1f} /{o['median']:>6.1f}"


def render_table(doc: dict[str, Any]) -> str:
    res, rat = doc["results"], doc["ratios"]
    lines = [
        f"transfer bench: {doc['mib']} MiB, {doc['rounds']} rounds (best / median), "
        f"{doc['frame_kib']} KiB frames, load {doc['setup']['loadavg_at_start'][0]:.2f}",
        f"{'mode':<13}{'fetch MiB/s':>22}{'offer ms':>16}{'end-to-end MiB/s':>22}",
    ]
    for mode, r in res.items():
        f, e = r["fetch_mib_s"], r["end_to_end_mib_s"]
        lines.append(
            f"{mode:<13}{f['best']:>11,.0f} /{f['median']:>8,.0f}"
            f"{_offer_cell(mode, r['offer_ms'])}"
            f"{e['best']:>11,.0f} /{e['median']:>8,.0f}"
        )
    lines.append("ratios, end to end (offer, the sender's copy included, + fetch):")
    for name, r in rat.items():
        goal = ""
        if "target" in r:
            goal = f"  target >= {r['target']} (median): {'met' if r['met'] else 'NOT met'}"
        lines.append(f"{name:<29}{r['best']:>6.2f} / {r['median']:.2f}{goal}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="halfmoon bench transfer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--mib", type=int, default=64, help="payload size in MiB")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per mode")
    p.add_argument("--frame-kib", type=int, default=1024, help="plain copy's frame size")
    p.add_argument("--json-out", default="", help="also write the JSON document here")
    p.add_argument(
        "--across-hosts",
        action="store_true",
        help="sender and receiver on two hosts (network namespaces, root): TCP only",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bind", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--sender-netns", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return asyncio.run(child(args.mib, args.frame_kib << 10, args.bind))
    if args.across_hosts and not args.sender_netns:  # make the hosts, then run in one
        from services.tools.bench import transfer_hosts

        return transfer_hosts.main(list(argv if argv is not None else sys.argv[1:]))
    where = across(args.sender_netns, args.bind) if args.sender_netns else None
    doc = asyncio.run(run(args.mib, max(1, args.rounds), args.frame_kib << 10, where))
    text = json.dumps(doc, indent=2)
    print(text)
    print(render_table(doc), file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
