"""`halfmoon cluster up`'s settings: `halfmoon up`'s, less what the topology decides."""

from __future__ import annotations

import ipaddress
import secrets

from pydantic import Field, field_validator, model_validator

from services.tools.hosts.topology import RUN_ID_LEN
from services.up.settings import UpSettings


class HostsSettings(UpSettings):
    console: bool = Field(False, description="not on the hosts cluster (run it on a host)")
    subnet: str = Field(
        "10.213.0.0/24",
        description="the hosts' network: the machine is .1 on it, the hosts .11, .12, ...",
    )
    run_id: str = Field(
        "",
        max_length=RUN_ID_LEN,
        description="names this run's namespaces hm-<id>-<host> (empty: random)",
    )

    @field_validator("subnet")
    @classmethod
    def _subnet(cls, v: str) -> str:
        ipaddress.ip_network(v)  # a ValueError says what is wrong
        return v

    @model_validator(mode="after")
    def _topology_decides(self) -> HostsSettings:
        """Flags of `halfmoon up` that the four-host layout fixes are refused by name."""
        refused = {
            "console": self.console,
            "colocated": self.colocated,
            "conductors": self.conductors != 1,
            "pin_engines": self.pin_engines,
        }
        named = [k for k, v in refused.items() if v]
        if named:
            raise ValueError(
                f"not supported on the hosts cluster (its layout decides): {', '.join(named)}"
            )
        if not self.run_id:
            self.run_id = secrets.token_hex(3)
        elif not self.run_id.isalnum():
            raise ValueError(f"run_id must be letters and digits: {self.run_id!r}")
        return self
