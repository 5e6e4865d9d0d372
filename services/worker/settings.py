"""Settings of an engine instance (flags and HALFMOON_ env vars), and its data plane."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from shared import tls
from shared.cpus import parse_cpus
from shared.engine.llm_engine import EngineConfig
from shared.engine.speculative import SpeculativeConfig
from shared.kv_load import KVLoadFailurePolicy
from shared.settings import DEFAULT_MODEL_NAME, BaseSettings, ContextSettings, halfmoon_home
from shared.transfer import KVReceiver, KVSender


class WorkerSettings(BaseSettings, ContextSettings):
    instance_id: str = Field("", description="instance id (empty: generated)")
    model: str = Field(
        DEFAULT_MODEL_NAME, description="model folder, or a name in HALFMOON_HOME/models"
    )
    served_model_name: str = Field("", description="model name clients use (empty: folder name)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="weights and KV dtype; auto: bfloat16 where the CPU computes it "
        "natively (AVX-512 BF16, AMX, AVX-NE-CONVERT), float32 otherwise",
    )
    quantization: Literal["none", "int8"] = Field(
        "none",
        description="int8: weight-only int8, per output channel (a "
        "quarter of fp32's bytes per decode step)",
    )
    lean_weights: bool = Field(
        False,
        description="keep each weight once (where the native kernels take every row "
        "count) and release transformers' copies: about a third of the memory, at some "
        "prefill speed on CPUs with AMX",
    )
    device: str = Field("cpu", description="torch device: cpu | cuda")
    threads: int = Field(0, ge=0, description="torch threads for this instance (0: torch default)")
    nice: int = Field(
        0,
        ge=0,
        le=19,
        description="CPU niceness: on a shared box a niced engine "
        "lets the control plane (gateway, conductor) answer at once",
    )
    cpus: str = Field(
        "",
        description="pin this instance to these CPUs, as the kernel lists them ('0', "
        "'0-1,4'; empty: no pinning)",
    )
    block_size: int = Field(16, gt=0, le=64, description="KV block size in tokens")
    kv_cache_gb: float = Field(1.0, gt=0, description="KV pool (DRAM tier) size in GiB")
    disk_tier_gb: float = Field(0.0, ge=0, description="KV disk tier size in GiB (0: off)")
    disk_tier_dir: str = Field(
        "", description="disk tier folder (empty: HALFMOON_HOME/kvdisk/<id>)"
    )
    max_num_seqs: int = Field(64, gt=0, description="sequences in the running batch at most")
    chunk_tokens: int = Field(
        512, gt=0, description="prefill chunk: tokens computed per step at most"
    )
    num_speculative_tokens: int = Field(
        0,
        ge=0,
        le=16,
        description="prompt-lookup speculative decoding: drafts per decode step at most, "
        "from what followed the last tokens earlier in the context (0: off; a request's "
        "num_speculative_tokens overrides it)",
    )
    prompt_lookup_min: int = Field(2, ge=1, description="shortest recurring suffix to draft from")
    prompt_lookup_max: int = Field(4, ge=1, description="longest recurring suffix tried first")
    speculative_disable_by_batch_size: int = Field(
        4, ge=1, description="no drafts while more sequences than this decode"
    )
    kv_host: str = Field("127.0.0.1", description="address the KV data plane binds")
    kv_advertise_host: str = Field("", description="address peers use to reach the data plane")
    kv_port: int = Field(0, ge=0, description="KV data plane port (0: any free port)")
    transfer_timeout_s: float = Field(30.0, gt=0, description="KV transfer timeout")
    kv_load_failure: KVLoadFailurePolicy = Field(
        "recompute",
        description="a KV load that fails (prefix pull, handoff, disk read): recompute the "
        "KV, or fail the request with kv_load_failed",
    )
    eviction: Literal["lru", "watermark"] = Field(
        "lru", description="lru: evict on demand; watermark: Mooncake Store's proactive eviction"
    )
    high_watermark: float = Field(
        0.90, gt=0, le=1, description="watermark eviction starts above this"
    )
    evict_ratio: float = Field(0.05, gt=0, lt=1, description="watermark eviction frees this share")
    hot_hits: int = Field(3, ge=0, description="soft-pin blocks hit this often (0: no pins)")
    pin_ttl_s: float = Field(60.0, gt=0, description="how long a hot block stays pinned")
    kv_transport: Literal["auto", "tcp"] = Field(
        "auto", description="auto: shared memory when both ends are on one host, else TCP"
    )
    # Data-plane TLS is mutual or off (shared/tls.py says why); docs/deploy.md, "Security".
    kv_tls_cert: str = Field(
        "",
        description="PEM certificate this instance presents on the "
        "KV data plane, as sender and receiver (with kv_tls_key and "
        "kv_tls_ca: mutual TLS; empty: plain TCP)",
    )
    kv_tls_key: str = Field("", description="private key of kv_tls_cert")
    kv_tls_ca: str = Field(
        "", description="CA bundle every peer's data-plane certificate must chain to"
    )
    kv_tls_hostname: str = Field(
        "",
        description="name peers' data-plane certificates are "
        "checked against (empty: the peer's advertised host)",
    )

    @model_validator(mode="after")
    def _kv_tls(self) -> WorkerSettings:
        tls.kv_contexts(self.kv_tls_cert, self.kv_tls_key, self.kv_tls_ca)  # loads, or says why
        return self

    @model_validator(mode="after")
    def _lookup(self) -> WorkerSettings:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        return self

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, v: str) -> str:
        if v:
            parse_cpus(v)  # a ValueError names what is wrong
        return v

    def engine_config(self) -> EngineConfig:
        disk_dir = self.disk_tier_dir or str(halfmoon_home() / "kvdisk" / self.instance_id)
        return EngineConfig(
            block_size=self.block_size,
            kv_cache_bytes=int(self.kv_cache_gb * 2**30),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.chunk_tokens,
            disk_tier_bytes=int(self.disk_tier_gb * 2**30),
            disk_tier_dir=disk_dir,
            eviction=self.eviction,
            kv_load_failure=self.kv_load_failure,
            high_watermark=self.high_watermark,
            evict_ratio=self.evict_ratio,
            hot_hits=self.hot_hits,
            pin_ttl_s=self.pin_ttl_s,
            quantization=self.quantization,
            lean_weights=self.lean_weights,
            speculative=SpeculativeConfig(
                self.num_speculative_tokens,
                self.prompt_lookup_min,
                self.prompt_lookup_max,
                self.speculative_disable_by_batch_size,
            ),
        )


def make_sender(settings: WorkerSettings) -> KVSender:
    from shared.transfer.shm import ShmKVSender
    from shared.transfer.tcp import TcpKVSender

    cls = ShmKVSender if settings.kv_transport == "auto" else TcpKVSender
    server_tls, _ = tls.kv_contexts(settings.kv_tls_cert, settings.kv_tls_key, settings.kv_tls_ca)
    return cls(settings.kv_host, settings.kv_port, settings.kv_advertise_host, tls=server_tls)


def make_receiver(settings: WorkerSettings) -> KVReceiver:
    from shared.transfer.shm import ShmKVReceiver
    from shared.transfer.tcp import TcpKVReceiver

    _, client_tls = tls.kv_contexts(settings.kv_tls_cert, settings.kv_tls_key, settings.kv_tls_ca)
    cls = ShmKVReceiver if settings.kv_transport == "auto" else TcpKVReceiver
    return cls(tls=client_tls, tls_hostname=settings.kv_tls_hostname)
