"""What the conductor's helpers (role switches, the planner loop) use of it: a Protocol,
so they need not import handlers.py, which builds them."""

from __future__ import annotations

from typing import Callable, Protocol

from nats.aio.client import Client as NATS

from services.conductor.args import ConductorSettings
from services.conductor.costmodel import CostModel
from services.conductor.registry import Registry
from shared.db.records import RecordWriter


class ConductorParts(Protocol):
    settings: ConductorSettings
    nc: NATS
    records: RecordWriter | None
    registry: Registry
    leading: Callable[[], bool]

    @property
    def cost(self) -> CostModel: ...
