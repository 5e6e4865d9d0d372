"""Cache load balancing's pull (Mooncake's Algorithm 1): before a prompt runs, fetch the
prefix blocks another instance holds, over the data plane, into this engine's pool."""

from __future__ import annotations

import logging

from services.worker.instance import EngineInstance
from shared import bus, errors, subjects
from shared.engine.kv_transfer import KVExport, KVMeta
from shared.messages import KVExportReply, KVExportRequest, PrefillJob
from shared.transfer import KVReceiver, TransferFailed
from shared.transfer.base import PREFIX

log = logging.getLogger(__name__)


async def pull_prefix(inst: EngineInstance, receiver: KVReceiver, job: PrefillJob) -> str:
    """Pull the job's prefix from `job.prefix_from` into `inst`'s engine; why it failed,
    or "" when the blocks are in (hash-checked against the prompt by the import)."""
    req = job.request
    try:
        reply = await bus.request(
            inst.nc,
            subjects.kv_export(job.prefix_from),
            KVExportRequest(block_hashes=req.block_hashes[: job.prefix_blocks]),
            KVExportReply,
            timeout_s=2.0,
        )
        meta_bytes, payload = await receiver.fetch(
            reply.handle, inst.settings.transfer_timeout_s, purpose=PREFIX
        )
        export = KVExport.from_bytes(KVMeta.model_validate_json(meta_bytes), payload)
        inst.count_transfer(True, len(payload))
        n = await inst.run_engine(
            inst.engine.import_prefix, req.prompt_token_ids, export, req.tenant
        )
    except (errors.HalfmoonError, TransferFailed, ValueError) as exc:
        return f"prefix pull from {job.prefix_from} failed ({exc})"
    log.info("request %s: pulled %d prefix tokens from %s", req.request_id, n, job.prefix_from)
    return ""
