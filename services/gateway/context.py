"""What every route group of the gateway shares: its settings, the bus, the SQL records,
the prompt builder, the metrics, and who is alive (from the instances' heartbeats)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.gateway.args import GatewaySettings
from services.gateway.logprobs import TokenTexts
from services.gateway.metrics import GatewayMetrics
from services.gateway.prompt import PromptBuilder
from services.gateway.streams import Liveness
from services.gateway.structured import ConstraintChecker
from shared.db.records import RecordWriter
from shared.messages import InstanceInfo


@dataclass
class GatewayContext:
    settings: GatewaySettings
    nc: NATS
    records: RecordWriter
    prompts: PromptBuilder
    instance_id: str
    started_at: float = field(init=False, default_factory=time.time)
    # Every instance's last heartbeat: who can still serve a stream, and /admin/state.
    liveness: Liveness = field(init=False)
    in_flight: int = field(init=False, default=0)  # generation requests being served
    metrics: GatewayMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.liveness = Liveness(self.settings.instance_expiry_s)
        self.metrics = GatewayMetrics(lambda: self.in_flight)

    @functools.cached_property
    def texts(self) -> TokenTexts:
        """Each token's text, for logprobs and token_strs (built on first use)."""
        return TokenTexts(self.prompts.tokenizer)

    @functools.cached_property
    def checker(self) -> ConstraintChecker:
        return ConstraintChecker(self.prompts.tokenizer, self.prompts.vocab_size)

    async def on_heartbeat(self, msg: Msg) -> None:
        try:
            info = InstanceInfo.model_validate_json(msg.data)
        except ValueError:
            return
        self.liveness.beat(info, time.monotonic())
