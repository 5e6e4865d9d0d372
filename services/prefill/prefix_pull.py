"""Cache load balancing's pull (Mooncake's Algorithm 1): before a prompt runs, fetch the
prefix blocks another instance holds, over the data plane, into this engine's pool."""

from __future__ import annotations

import logging

from services.worker.instance import EngineInstance
from shared import bus, errors, subjects
from shared.engine.kv_transfer import KVExport, KVMeta
from shared.kv_messages import KVReplicate
from shared.messages import KVExportReply, KVExportRequest, PrefillJob
from shared.transfer import KVReceiver, TransferFailed
from shared.transfer.base import PREFIX

log = logging.getLogger(__name__)


async def pull_prefix(inst: EngineInstance, receiver: KVReceiver, job: PrefillJob) -> str:
    """Pull the job's prefix from `job.prefix_from` into `inst`'s engine; why it failed,
    or "" when the blocks are in (hash-checked against the prompt by the import)."""
    req = job.request
    hashes = req.block_hashes[: job.prefix_blocks]
    try:
        n, _ = await pull_blocks(
            inst, receiver, job.prefix_from, hashes, req.prompt_token_ids, req.tenant
        )
    except (errors.HalfmoonError, TransferFailed, ValueError) as exc:
        return f"prefix pull from {job.prefix_from} failed ({exc})"
    log.info("request %s: pulled %d prefix tokens from %s", req.request_id, n, job.prefix_from)
    return ""


async def replicate(inst: EngineInstance, receiver: KVReceiver, order: KVReplicate) -> None:
    """A hot prefix's copy, ordered ahead of demand (conductor/replication.py): pulled
    like a request's prefix and kept as a replica. A failure only logs: no request waits
    on it, and the conductor forgets a copy that never shows up in the index."""
    try:
        n, nbytes = await pull_blocks(
            inst, receiver, order.source, order.block_hashes, order.token_ids, order.tenant, True
        )
    except (errors.HalfmoonError, TransferFailed, ValueError) as exc:
        log.warning("replica of a hot prefix from %s failed (%s)", order.source, exc)
        return
    if not n:
        log.warning("replica of a hot prefix from %s: no room in the pool now", order.source)
        return
    inst.kv_activity.replicas += 1
    inst.kv_activity.replica_bytes += nbytes
    await inst.publish_dram_changes()  # the index learns of the new holder now
    log.info(
        "replicated %d tokens of a hot prefix (%.2f req/s) from %s", n, order.heat_rps, order.source
    )


async def pull_blocks(
    inst: EngineInstance,
    receiver: KVReceiver,
    source: str,
    hashes: list[int],
    token_ids: list[int],
    tenant: str,
    replica: bool = False,
) -> tuple[int, int]:
    """Fetch `source`'s cached blocks of `hashes` over the data plane and import them:
    (the tokens they cover, the bytes fetched). Raises what the export, the fetch or the
    import raised."""
    reply = await bus.request(
        inst.nc,
        subjects.kv_export(source),
        KVExportRequest(block_hashes=hashes),
        KVExportReply,
        timeout_s=2.0,
    )
    meta_bytes, payload = await receiver.fetch(
        reply.handle, inst.settings.transfer_timeout_s, purpose=PREFIX
    )
    export = KVExport.from_bytes(KVMeta.model_validate_json(meta_bytes), payload)
    inst.count_transfer(True, len(payload))
    n = await inst.run_engine(inst.engine.import_prefix, token_ids, export, tenant, replica)
    return n, len(payload)
