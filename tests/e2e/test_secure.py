"""The whole stack with its control plane and data plane locked down, the way a networked
deployment runs (docs/deploy.md, "Security"): NATS requires TLS, a client certificate from
the cluster CA and a password; prefill hands its KV to decode over mutual-TLS TCP. Chat
output must still be transformers' greedy output, with the KV transferred, not recomputed.
"""

from __future__ import annotations

import secrets

import aiohttp
import pytest

from shared.natsd import EmbeddedNats
from tests.conftest import make_database
from tests.e2e.conftest import children_of, start_stack, stop_stack
from tests.e2e.test_chat import reference, stream_chat  # fixtures, used by name
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.model]
PROMPTS = ["What is the capital of France?", "List three prime numbers."]


@pytest.fixture(scope="module")
def secure_stack(tmp_path_factory, model_dir, pki):
    tmp = tmp_path_factory.mktemp("secure-stack")
    password = secrets.token_hex(16)
    nats_server = EmbeddedNats(
        tmp / "nats",
        tls_cert=pki.cert,
        tls_key=pki.key,
        tls_ca=pki.ca,
        user="halfmoon",
        password=password,
    )
    nats_url = nats_server.start()
    database_url, _ = make_database("sqlite", tmp)
    env = {
        "HALFMOON_NATS_USER": "halfmoon",
        "HALFMOON_NATS_PASSWORD": password,
        "HALFMOON_NATS_TLS_CA": pki.ca,
        "HALFMOON_NATS_TLS_CERT": pki.cert,
        "HALFMOON_NATS_TLS_KEY": pki.key,
        "HALFMOON_KV_TLS_CERT": pki.cert,
        "HALFMOON_KV_TLS_KEY": pki.key,
        "HALFMOON_KV_TLS_CA": pki.ca,
        "HALFMOON_KV_TRANSPORT": "tcp",
    }  # KV bytes over TLS, not shared memory
    try:
        # `halfmoon up` and every service it starts read these from the environment.
        with pytest.MonkeyPatch.context() as mp:
            for name, value in env.items():
                mp.setenv(name, value)
            stack = start_stack(
                tmp, model_dir, database_url, ["--dtype", "float32", "--nats-url", nats_url]
            )
        # conductor, kvmanager, prefill, decode, gateway: no embedded nats-server
        assert len(children_of(stack.proc.pid)) == 5
        yield stack
        rc = stop_stack(stack)
        assert rc == 0, f"halfmoon up exited {rc}:\n{stack.log()[-3000:]}"
    finally:
        nats_server.stop()


async def _decode_transfers_in(url: str) -> int:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/admin/state") as resp:
            state = await resp.json()
    return sum(
        i["kv_activity"]["transfers_in"] for i in state["instances"] if i["role"] == "decode"
    )


async def test_chat_over_nats_credentials_and_tls_matches_transformers(secure_stack, reference):
    for prompt in PROMPTS:
        text, chunks = await stream_chat(secure_stack.url, prompt, 32)
        assert text == reference(prompt, 32)[1], f"prompt {prompt!r}"
        assert chunks[-1]["usage"]["completion_tokens"] > 0
    log = secure_stack.log()
    assert "(mutual TLS)" in log  # the prefill instance serves its KV over mutual TLS
    assert "recomputing" not in log  # every handoff came over the data plane

    async def counted() -> bool:  # heartbeats carry the counts, once a second
        return await _decode_transfers_in(secure_stack.url) >= len(PROMPTS)

    await until(counted, what="the handoffs in the decode's heartbeat", step_s=0.2)
