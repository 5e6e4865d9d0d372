"""From the live registry and the KV manager's match to the policies' pure Snapshot."""

from __future__ import annotations

from services.conductor.costmodel import CostModel
from services.conductor.registry import InstanceState
from services.conductor.views import InstanceView, RequestView, Snapshot
from shared.messages import GenerateRequest


def prefill_view(state: InstanceState, cost: CostModel) -> InstanceView:
    """Queue time: the predicted prefill of each prompt the instance reported still to
    compute, plus what this conductor sent it since that report (not in it yet).

    Kept in the state until its next heartbeat or dispatch (registry.py), and the queue's
    work priced once per heartbeat, with the cost model of that moment: a decision on a
    large cluster must not run the cost model over every queued prompt of every
    instance."""
    if state.queue_work_s is None:
        state.queue_work_s = sum(cost.prefill_s(n) for n in state.info.queue_prompts)
    view = state.prefill_view = InstanceView(
        state.info.instance_id,
        queue_s=state.queue_work_s + state.pending_s,
        running=state.info.running,
        load=state.load,
    )
    return view


def decode_view(state: InstanceState) -> InstanceView:
    """Batch and context as reported plus what was sent since. Room: free blocks, less
    those held for imports waiting for room and those promised to dispatches since the
    report (so two quick decisions do not both count the same blocks); unknown (None)
    for an instance that reports no pool."""
    info = state.info
    running = info.running + state.dispatched_since_beat
    context = info.mean_context * info.running + state.pending_tokens
    room = (
        info.kv_blocks_free - info.kv_blocks_leased - state.pending_blocks
        if info.kv_blocks_total
        else None
    )
    view = state.decode_view = InstanceView(
        info.instance_id,
        running=running,
        load=state.load,
        mean_context=context / running if running else 0.0,
        kv_blocks_free=room,
    )
    return view


def build(
    prefills: list[InstanceState],
    decodes: list[InstanceState],
    cost: CostModel,
    threshold: float,
    slo_margin: float = 1.0,
    colocated: bool = False,
    max_stages: int = 1,
    pipeline_min_tokens: int = 0,
) -> Snapshot:
    """`prefills` may hold colocated instances (heartbeats that say so): each one's own
    batch goes in `own_decodes`, since it decodes what it prefills."""
    # a view kept from an earlier decision, else a fresh one (kept for the next)
    return Snapshot(
        [p.prefill_view or prefill_view(p, cost) for p in prefills],
        [d.decode_view or decode_view(d) for d in decodes],
        cost,
        threshold,
        slo_margin,
        colocated,
        own_decodes={
            p.info.instance_id: p.decode_view or decode_view(p)
            for p in prefills
            if p.info.colocated and not colocated
        },
        max_stages=max_stages,
        pipeline_min_tokens=pipeline_min_tokens,
    )


def request_view(
    req: GenerateRequest,
    matches: dict[str, int],
    ttft_slo_s: float,
    tbt_slo_s: float,
    on_disk: dict[str, int] | None = None,
    decode_blocks: dict[str, int] | None = None,
    hot: tuple[int, float] = (0, 0.0),
) -> RequestView:
    ttft = req.ttft_slo_ms / 1e3 if req.ttft_slo_ms else ttft_slo_s
    tbt = req.tbt_slo_ms / 1e3 if req.tbt_slo_ms else tbt_slo_s
    return RequestView(
        req.request_id,
        len(req.prompt_token_ids),
        matches,
        ttft,
        tbt,
        req.sampling.max_tokens,
        on_disk or {},
        decode_blocks or {},
        *hot,
    )
