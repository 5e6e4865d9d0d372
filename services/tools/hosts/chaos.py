"""`halfmoon cluster chaos`: each fault of faults.py under a steady load on the hosts
cluster, and a table of what it cost: time until whole again, and how requests ended.

Requests are Poisson streaming chats spread over both gateways (a client per gateway, as
behind a load balancer without retries). Each ends as one of:
- completed: every token, then a finish;
- error: a clear error reply or event from the gateway (its code is the reason);
- cut: the connection to its gateway broke or was refused (that gateway's host died);
- hung: no terminal event within the request deadline (must be 0);
- inconsistent: finished with the wrong number of tokens (must be 0).
Every request a gateway gave an id must end with one terminal SQL row: `lost` counts those
that did not (must be 0).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from pydantic import Field, field_validator

from services.tools.bench.client import Result
from services.tools.chaos.audit import audit
from services.tools.chaos.load import Load, outcome
from services.tools.chaos.run import model_name
from services.tools.hosts.cluster import HostCluster
from services.tools.hosts.faults import CAUGHT_TOKENS, FAULTS, Fault, faults, whole_again
from services.tools.hosts.run import run
from services.tools.hosts.settings import HostsSettings
from services.tools.hosts.throttle import ThrottleReport, throttle_run
from shared.lifecycle import setup_logging
from shared.settings import parse_settings

log = logging.getLogger("halfmoon.hosts")


CHOICES = (*FAULTS, "throttle")


class HostsChaosSettings(HostsSettings):
    faults: str = Field(",".join(CHOICES), description="comma separated: " + ", ".join(CHOICES))
    rate: float = Field(1.0, gt=0, description="requests per second, over both gateways")
    max_tokens: int = Field(16, gt=0, description="tokens each request streams (EOS ignored)")
    before_s: float = Field(5.0, ge=0, description="load before each fault")
    after_s: float = Field(5.0, ge=0, description="load after the service is whole again")
    link_down_s: float = Field(5.0, gt=0, description="how long the link-down fault lasts")
    recovery_limit_s: float = Field(240.0, gt=0, description="give up on a recovery then")
    request_deadline_s: float = Field(180.0, gt=0, description="a request not ended by then hung")
    throttle_mbit: float = Field(100.0, gt=0, description="the throttle: host d's link rate")
    throttle_requests: int = Field(16, ge=2, description="the throttle: requests, one at a time")
    throttle_calibrate: int = Field(
        10, ge=1, description="the throttle: requests before its predictions are scored"
    )
    json_out: str = Field("", description="also write the report here")

    @field_validator("faults")
    @classmethod
    def _known(cls, v: str) -> str:
        unknown = [f for f in v.split(",") if f not in CHOICES]
        if unknown:
            raise ValueError(f"unknown faults {unknown}; choose from {', '.join(CHOICES)}")
        return v


@dataclass
class FaultReport:
    fault: str
    what: str
    recovery_s: float | None
    sent: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)  # "outcome: reason" -> requests
    retried: dict[str, int] = field(default_factory=dict)  # the gateways' retries, by why
    caught: str = ""  # how the request the fault aimed at ended (link-down: mid-handoff)
    sql_rows: dict[str, int] = field(default_factory=dict)  # terminal status -> rows
    lost: int = 0


def classify(res: Result, max_tokens: int) -> tuple[str, str]:
    """(outcome, reason) of one request."""
    kind = outcome(res, max_tokens)
    if kind == "hung" and res.error and not res.error.startswith("TimeoutError"):
        return "cut", res.error.split(":")[0]  # the exception's class: connection refused...
    if kind == "error":
        code = re.search(r"""['"]code['"]: ?['"]([^'"]+)""", res.error)
        return kind, code.group(1) if code else res.error[:60]
    return kind, ""


async def one_fault(c: HostCluster, fault: Fault, s: HostsChaosSettings, model: str) -> FaultReport:
    stop = asyncio.Event()
    urls = c.t.gateway_urls()
    loads = [
        Load(url, model, s.rate / len(urls), s.max_tokens, s.request_deadline_s, random.Random(i))
        for i, url in enumerate(urls)
    ]
    since = time.time()
    retries_before = await gateway_retries(urls)
    sending = [asyncio.create_task(load.run(time.monotonic() + 3600, stop)) for load in loads]
    await asyncio.sleep(s.before_s)
    log.warning("fault %s: %s", fault.name, fault.what)
    t0 = time.monotonic()
    aimed = await fault.inject(c, model)
    recovery = await whole_again(c, model, t0, s.recovery_limit_s)
    log.warning("fault %s: whole again after %s s", fault.name, recovery)
    await asyncio.sleep(s.after_s)
    stop.set()
    await asyncio.gather(*sending)
    retried = retries_since(retries_before, await gateway_retries(urls))
    results = [r for load in loads for r in load.results]
    ids = {r.request_id for r in results if r.request_id}
    rows = await audit(c.database_url, since, ids)
    kinds = [classify(r, s.max_tokens) for r in results]
    return FaultReport(
        fault.name,
        fault.what,
        None if recovery is None else round(recovery, 1),
        sent=len(results),
        outcomes=dict(Counter(k for k, _ in kinds)),
        reasons=dict(Counter(f"{k}: {why}" for k, why in kinds if why)),
        retried={k: v for k, v in retried.items() if v},
        caught=": ".join(x for x in classify(aimed, CAUGHT_TOKENS) if x) if aimed else "",
        sql_rows=dict(rows.by_status),
        lost=rows.lost,
    )


@dataclass
class Reports:
    faults: list[FaultReport] = field(default_factory=list)
    throttle: ThrottleReport | None = None


async def gateway_retries(urls: list[str]) -> list[dict[str, float]]:
    """Each gateway's halfmoon_gateway_retries_total by reason ({} if it does not answer)."""
    out: list[dict[str, float]] = []
    for url in urls:
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as h:
                async with h.get(f"{url}/metrics") as resp:
                    text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            out.append({})
            continue
        counts: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "halfmoon_gateway_retries_total":
                    counts[sample.labels["reason"]] = sample.value
        out.append(counts)
    return out


def retries_since(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, int]:
    """Retries between two readings, summed over gateways; a gateway that restarted in
    between counts from zero."""
    total: Counter[str] = Counter()
    for b, a in zip(before, after):
        restarted = any(a.get(k, 0) < v for k, v in b.items())
        for reason, value in a.items():
            total[reason] += int(value if restarted else value - b.get(reason, 0))
    return dict(total)


async def chaos(c: HostCluster, s: HostsChaosSettings) -> Reports:
    model = await model_name(c.t.gateway_urls()[0])
    table = faults(s.link_down_s)
    out = Reports()
    reports = out.faults
    for name in s.faults.split(","):
        if name == "throttle":
            log.warning("throttle: host d's link at %g Mbit/s", s.throttle_mbit)
            out.throttle = await throttle_run(
                c, model, s.throttle_mbit, s.throttle_requests, s.throttle_calibrate
            )
            continue
        reports.append(await one_fault(c, table[name], s, model))
        if reports[-1].recovery_s is None:
            log.error("fault %s: not whole again in %.0f s; stopping", name, s.recovery_limit_s)
            break
    return out


def render(reports: list[FaultReport]) -> str:
    head = f"{'fault':<13}{'whole again s':>14}{'sent':>6}{'done':>6}{'error':>6}"
    head += f"{'cut':>5}{'hung':>6}{'lost':>6}  reasons"
    lines = [head]
    for r in reports:
        o = r.outcomes
        rec = "never" if r.recovery_s is None else f"{r.recovery_s:.1f}"
        reasons = "; ".join(f"{k} x{n}" for k, n in sorted(r.reasons.items()))
        retried = "; ".join(f"retried: {k} x{n}" for k, n in sorted(r.retried.items()))
        caught = f"caught mid-handoff: {r.caught}" if r.caught else ""
        reasons = "; ".join(x for x in (reasons, retried, caught) if x) or "-"
        lines.append(
            f"{r.fault:<13}{rec:>14}{r.sent:>6}{o.get('completed', 0):>6}{o.get('error', 0):>6}"
            f"{o.get('cut', 0):>5}{o.get('hung', 0) + o.get('inconsistent', 0):>6}{r.lost:>6}"
            f"  {reasons}"
        )
    return "\n".join(lines)


def render_throttle(t: ThrottleReport) -> str:
    lines = [f"throttle: host d's link at {t.mbit:g} Mbit/s, one request at a time"]
    lines.append(f"{'#':>3}{'blocks':>8}{'predicted s':>13}{'measured s':>12}")
    for i, r in enumerate(t.rows):
        mark = "" if i >= t.calibrate else "  (calibrating)"
        lines.append(
            f"{i:>3}{r['blocks']:>8}{r['predicted_s']:>13.3f}{r['measured_s']:>12.3f}{mark}"
        )
    sm = t.summary()
    lines.append(
        f"after calibration: median |predicted/measured - 1| {sm['median_error']:.1%}, "
        f"max {sm['max_error']:.1%}, target <= {sm['target']:.0%}: "
        + ("met" if sm["met"] else "NOT met")
    )
    return "\n".join(lines)


def report(out: Reports, s: HostsChaosSettings) -> int:
    reports = out.faults
    doc: dict[str, Any] = {"bench": "cluster chaos", "faults": [asdict(r) for r in reports]}
    if out.throttle is not None:
        doc["throttle"] = {**asdict(out.throttle), **out.throttle.summary()}
    text = json.dumps(doc, indent=2)
    print(text)
    print(render(reports), file=sys.stderr)
    if out.throttle is not None:
        print(render_throttle(out.throttle), file=sys.stderr)
    if s.json_out:
        with open(s.json_out, "w") as f:
            f.write(text + "\n")
    bad = any(
        r.recovery_s is None
        or r.lost
        or r.outcomes.get("hung")
        or r.outcomes.get("inconsistent")
        or r.caught.startswith(("hung", "inconsistent"))
        for r in reports
    )
    ran = len(reports) + (out.throttle is not None)
    return 1 if bad or ran < len(s.faults.split(",")) else 0


def main(argv: Sequence[str]) -> int:
    s = parse_settings(
        HostsChaosSettings,
        argv,
        "halfmoon cluster chaos",
        "Each fault of a cluster of hosts under load: time until whole, how requests ended.",
    )
    setup_logging(s.log_level, "cluster")
    results: list[Reports] = []

    async def body(c: HostCluster) -> int:
        results.append(await chaos(c, s))
        return report(results[0], s)

    try:
        return asyncio.run(run(s, body))
    except KeyboardInterrupt:
        return 130
