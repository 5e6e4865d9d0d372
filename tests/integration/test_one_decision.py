"""One decision, seen the same everywhere: over a real nats-server and real SQL, the
conductor's prediction (the Placement), its SQL decision record, the PrefillJob it
dispatches and the simulator's outcome for the same cluster state all agree, the prefix
pull and its transfer time included.

The neighbours are plain NATS subscribers: two prefill instances that take any job, a
decode instance's heartbeat and a KV manager that answers the prefix match.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import nats
import pytest
from sqlalchemy import select

from services.conductor.args import ConductorSettings
from services.conductor.costmodel import CostModel
from services.conductor.handlers import Conductor
from services.conductor.policy import make_policy
from services.tools.sim.model import Outcome, SimRequest
from services.tools.sim.prefill import PrefillJob as SimJob
from services.tools.sim.run import Cluster, SimConfig
from shared import bus, subjects
from shared.db.records import RecordWriter
from shared.db.schema import DecisionRecord
from shared.db.session import make_engine, sessionmaker
from shared.kv_messages import KVMatchReply
from shared.messages import (
    Ack,
    InstanceInfo,
    Placement,
    PrefillJob,
    Role,
)
from tests.factories import request
from tests.waiting import until

BS = 16
# Round numbers: 1 ms per new prefill token, 2 ms per transferred block, 40 ms overhead.
COST = CostModel(
    prefill_coef=[0.0, 1e-3, 0.0, 0.0],
    decode_coef=[0.01, 1e-3, 0.0],
    transfer_latency_s=0.0,
    transfer_bytes_per_s=1000.0,
    block_bytes=2,
    block_size=BS,
    overhead_s=0.04,
    source="test",
)
HASHES = [1000 + i for i in range(10)]
PROMPT = 10 * BS + 5  # 10 full blocks and 5 tokens
MAX_TOKENS = 8
QUEUED_TOKENS = 2000  # p00's queue: 2 s of predicted prefill


@dataclass(frozen=True)
class Case:
    name: str
    cached: dict[str, int]  # instance -> leading blocks of HASHES it holds
    prefill: str  # expected placement
    pull_from: str
    prefix_blocks: int


CASES = [
    # p00 holds 6 blocks behind a queue; p01 has none: pulling 6 blocks (12 ms) beats 2 s.
    Case("pull", {"p00": 6}, "p01", "p00", 6),
    # p01 holds 5 of p00's 6: 6/5 is under the balancing threshold, so kvcentric computes
    # on its own cache (the live conductor used to add a pull here whatever the policy).
    Case("own_cache", {"p00": 6, "p01": 5}, "p01", "", 5),
]


@pytest.fixture
async def live(nats_url, db_url, tmp_path):
    """A conductor (kvcentric, recording to SQL) and the subscribers around it."""
    cost_path = tmp_path / "cost.json"
    COST.save(cost_path)
    settings = ConductorSettings(
        nats_url=nats_url,
        cost_model=str(cost_path),
        slo_margin=1.0,
        heartbeat_expiry_s=30.0,
        election=False,
    )
    nc = await nats.connect(nats_url)
    engine = make_engine(db_url)
    records = RecordWriter(engine, flush_interval_s=0.0)
    await records.start()
    conductor = Conductor(settings, nc, records)
    jobs: list[PrefillJob] = []
    matches: dict[str, int] = {}

    async def on_submit(msg):
        jobs.append(PrefillJob.model_validate_json(msg.data))
        await bus.respond(msg, Ack())

    async def on_match(msg):
        await bus.respond(msg, KVMatchReply(matches=matches))

    subs = [
        await nc.subscribe(subjects.HEARTBEAT_ALL, cb=conductor.on_heartbeat),
        await nc.subscribe(subjects.CONDUCTOR_SCHEDULE, cb=conductor.on_schedule),
        await nc.subscribe(subjects.KV_MATCH, cb=on_match),
        *[await nc.subscribe(subjects.prefill_submit(p), cb=on_submit) for p in ("p00", "p01")],
    ]
    yield nc, conductor, records, engine, jobs, matches
    for s in subs:
        await s.unsubscribe()
    await records.close()
    await engine.dispose()
    await nc.close()


async def beat(nc, iid: str, role: Role, **kw) -> None:
    info = InstanceInfo(instance_id=iid, role=role, sent_at=time.time(), **kw)
    await nc.publish(subjects.heartbeat(role.value, iid), info.encode())


def simulate(case: Case) -> tuple[Outcome, SimJob]:
    """The same cluster state in the simulator: p00's queue, both pools, one idle decode."""
    cfg = SimConfig(
        num_prefill=2,
        num_decode=1,
        cache_blocks=None,
        cost=COST,
        block_tokens=BS,
        ttft_slo_s=30.0,
        tbt_slo_s=0.3,
        prewarm=False,
    )
    cluster = Cluster(cfg, make_policy("kvcentric"))
    for iid, n in case.cached.items():
        cluster._admit(cluster.prefills[iid], HASHES[:n], 0.0)
    ahead = Outcome(SimRequest(-1, 0.0, QUEUED_TOKENS, 1, []))
    cluster.prefills["p00"].enqueue(SimJob(ahead, "", 0, COST.prefill_s(QUEUED_TOKENS)))
    cluster.arrive(SimRequest(0, 0.0, PROMPT, MAX_TOKENS, list(HASHES)))
    out = cluster.outcomes[-1]
    job = cluster.prefills[out.prefill_id].running
    assert job is not None and job.outcome is out
    cluster.run_until(math.inf)  # its prefill (and the pull) runs: the outcome is measured
    return out, job


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
async def test_prediction_record_dispatch_and_simulator_agree(live, case):
    nc, conductor, records, engine, jobs, matches = live
    matches.update(case.cached)
    await beat(nc, "p00", Role.PREFILL, queue_depth=1, queue_prompts=[QUEUED_TOKENS])
    await beat(nc, "p01", Role.PREFILL)
    await beat(nc, "d00", Role.DECODE, kv_blocks_total=64, kv_blocks_free=64)
    await until(
        lambda: (
            len(conductor.registry.alive(Role.PREFILL, time.time())) == 2
            and conductor.registry.alive(Role.DECODE, time.time())
        ),
        5.0,
    )

    placement = await bus.request(
        nc,
        subjects.CONDUCTOR_SCHEDULE,
        request(case.name, prompt=range(PROMPT), max_tokens=MAX_TOKENS, block_hashes=HASHES),
        Placement,
        5,
    )
    await records.flush()
    async with sessionmaker(engine)() as s:
        row = (
            await s.execute(select(DecisionRecord).where(DecisionRecord.request_id == case.name))
        ).scalar_one()
    out, sim_job = simulate(case)

    # Where: the same prefill and decode everywhere.
    assert placement.prefill_id == row.prefill_instance == out.prefill_id == case.prefill
    assert placement.decode_id == row.decode_instance == out.decode_id == "d00"
    # The pull: dispatched as decided, recorded as decided, simulated as decided.
    (job,) = jobs
    chosen = next(c for c in row.candidates if c["instance"] == case.prefill)
    assert (job.prefix_from, sim_job.pull_from, chosen["pull_from"]) == (case.pull_from,) * 3
    assert job.prefix_blocks == (case.prefix_blocks if case.pull_from else 0)
    assert chosen["prefix_blocks"] == sim_job.pull_blocks == out.reused_blocks == case.prefix_blocks
    pulled = case.prefix_blocks - case.cached.get(case.prefill, 0) if case.pull_from else 0
    assert out.pulled_blocks == pulled
    # The prediction: transfer + queue + prefill + overhead, the same number in the
    # Placement, in SQL and in the simulator, and what the simulated prefill then took.
    transfer_s = COST.transfer_s(pulled)
    cached = case.prefix_blocks * BS
    expected_s = COST.overhead_s + transfer_s + COST.prefill_s(PROMPT - cached, cached)
    assert chosen["transfer_ms"] == pytest.approx(transfer_s * 1e3)
    assert placement.predicted_ttft_ms == pytest.approx(expected_s * 1e3)
    assert row.predicted_ttft_ms == pytest.approx(placement.predicted_ttft_ms)
    assert out.predicted_ttft_s == pytest.approx(expected_s)
    assert out.ttft_s == pytest.approx(expected_s)
    # The decode's room is promised to this request until d00's next heartbeat.
    d00 = next(s for s in conductor.registry.alive(Role.DECODE, time.time()))
    assert d00.pending_blocks == -(-(PROMPT + MAX_TOKENS) // BS) == 11


async def test_a_later_sample_follows_the_first_to_its_prefill(live):
    """n > 1: the gateway places a prompt's first sample, then the others with
    follow_prefill. Two idle instances and no cache: the first sample's dispatch makes p00
    the busier one, so kvcentric would send the next sample to p01 to compute the prompt
    again; following, it goes to p00, predicted to finish with the first (the prompt counts
    as held there), and is recorded and dispatched as that one decision."""
    nc, conductor, records, engine, jobs, matches = live
    await beat(nc, "p00", Role.PREFILL)
    await beat(nc, "p01", Role.PREFILL)
    await beat(nc, "d00", Role.DECODE, kv_blocks_total=64, kv_blocks_free=64)
    await until(lambda: len(conductor.registry.alive(Role.PREFILL, time.time())) == 2, 5.0)
    await until(lambda: bool(conductor.registry.alive(Role.DECODE, time.time())), 5.0)

    async def place(rid: str, follow: str = "") -> Placement:
        req = request(
            rid, prompt=range(PROMPT), max_tokens=MAX_TOKENS, block_hashes=HASHES
        ).model_copy(update={"follow_prefill": follow})
        return await bus.request(nc, subjects.CONDUCTOR_SCHEDULE, req, Placement, 5)

    first = await place("r-0")
    assert first.prefill_id == "p00"  # a tie between idle instances: the smaller id
    free = await place("free")  # the same prompt placed on its own
    assert free.prefill_id == "p01"
    second = await place("r-1", follow="p00")
    assert second.prefill_id == "p00" and second.decode_id == "d00"
    # Predicted: p00's queue (the first sample's prefill) plus the prompt's last token,
    # what the first sample was predicted plus that token.
    last_token_s = COST.prefill_s(PROMPT - 10 * BS, 10 * BS)
    first_prefill_s = COST.prefill_s(PROMPT)
    assert second.predicted_ttft_ms == pytest.approx(
        (COST.overhead_s + first_prefill_s + last_token_s) * 1e3
    )
    assert first.predicted_ttft_ms == pytest.approx((COST.overhead_s + first_prefill_s) * 1e3)
    # Dispatched as decided (no pull: the prompt is the first sample's, on that engine).
    job = next(j for j in jobs if j.request.request_id == "r-1")
    assert (job.prefix_from, job.prefix_blocks, job.request.follow_prefill) == ("", 0, "p00")
    await records.flush()
    async with sessionmaker(engine)() as s:
        row = (
            await s.execute(select(DecisionRecord).where(DecisionRecord.request_id == "r-1"))
        ).scalar_one()
    assert row.prefill_instance == "p00"
    assert row.predicted_ttft_ms == pytest.approx(second.predicted_ttft_ms)
    assert [(c["instance"], c["prefix_blocks"]) for c in row.candidates] == [("p00", 10)]

    # An instance that is gone is not followed: the policy decides.
    gone = await place("r-2", follow="p99")
    assert gone.prefill_id == "p01"
