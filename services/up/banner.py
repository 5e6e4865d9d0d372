"""What `halfmoon up` prints once the cluster is ready: where everything listens, and what
each engine runs."""

from __future__ import annotations

from services.up.cluster import LocalCluster
from services.up.settings import UpSettings
from shared.db import session as db
from shared.engine import cpu


def banner(s: UpSettings, cluster: LocalCluster) -> str:
    lines = [
        "",
        "Halfmoon is up.",
        f"  API      http://{s.host}:{s.port}/v1   (OpenAI-compatible; model: see /v1/models)",
    ]
    if s.console:
        lines.append(f"  console  http://{s.host}:{s.console_port}")
    lines += metrics_lines(s, cluster)
    lines += [
        f"  NATS     {cluster.nats_url}",
        f"  SQL      {db.resolve_url(cluster.database_url).split('@')[-1]}",
        f"  workers  {_workers(s)}",
        f"  engines  {_engines(s)}",
        "Ctrl-C stops everything.",
        "",
    ]
    return "\n".join(lines)


def metrics_lines(s: UpSettings, cluster: LocalCluster) -> list[str]:
    """The gateway's /metrics, then each child's, in start order."""
    urls = [(f"http://{s.host}:{s.port}/metrics", "gateway")]
    urls += [
        (f"http://{s.host}:{port}/metrics", name) for name, port in cluster.metrics_ports.items()
    ]
    return [
        f"  {'metrics' if i == 0 else '':8} {url} ({name})" for i, (url, name) in enumerate(urls)
    ]


def _engines(s: UpSettings) -> str:
    """The dtype and kernels each engine picks on this CPU, and why."""
    info = cpu.detect()
    dtype, why = cpu.resolve_dtype(s.dtype)
    capped = f", capped by {cpu.ISA_ENV}={info.isa}" if info.isa != "native" else ""
    return (
        f"{dtype} ({why}), quantization {s.quantization}; CPU {info.model}: "
        f"kernels for {info.level}{capped}"
    )


def _workers(s: UpSettings) -> str:
    if s.colocated:
        return f"{s.colocated} colocated (prefill + decode each), policy {s.policy}"
    return f"{s.prefill} prefill, {s.decode} decode, policy {s.policy}"
