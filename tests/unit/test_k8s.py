"""deploy/k8s: every overlay renders, validates against the Kubernetes 1.32 schemas, and keeps the contract the
processes rely on.

No cluster is needed: `kubectl kustomize` renders a copy of deploy/k8s whose secrets/ folders are filled by
`pdserve certs --k8s` (real certificates), `kubernetes-validate` checks each object, and the contract checks
read the rendered objects: each container's args, with Kubernetes' $(VAR) expansion, parse with pdserve's own
CLI parser and name exactly the ports the container declares; probes hit the health port; pods run non-root on
a read-only root filesystem; the grace period covers the drain; and the NetworkPolicies, evaluated here, admit
exactly the edges of the design (DESIGN §3, §10).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from decode_worker.config import DecodeWorkerConfig
from pdserve import cli_args
from pdserve.cli_args import build_parser
from prefill_worker.config import PrefillWorkerConfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
CRD_GROUPS = ("monitoring.coreos.com/", "cert-manager.io/")  # validated by their operators, not by 1.32 schemas
COMPONENTS = ("gateway", "prefill", "decode", "redis", "model-fetch")

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) is not installed")


@lru_cache(maxsize=None)
def rendered(overlay: str, tmp_root: str) -> tuple[dict, ...]:
    tree = Path(tmp_root) / overlay / "k8s"
    shutil.copytree(K8S, tree)
    from pdserve.cli import main

    assert main(["certs", "--k8s", str(tree / "overlays" / overlay / "secrets")]) == 0
    out = subprocess.run(["kubectl", "kustomize", str(tree / "overlays" / overlay)], check=True,
                         capture_output=True, text=True).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


@pytest.fixture(scope="module")
def objects(tmp_path_factory) -> dict[str, tuple[dict, ...]]:
    root = str(tmp_path_factory.mktemp("k8s"))
    return {overlay: rendered(overlay, root) for overlay in OVERLAYS}


def pod_specs(docs) -> list[tuple[dict, dict]]:
    """(object, pod spec) of every workload."""
    out = []
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            out.append((doc, doc["spec"]["template"]["spec"]))
    return out


def component(doc: dict) -> str:
    return doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


# ------------------------------------------------------------------------------------------------- schemas
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_kubernetes_1_32(objects, overlay):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    checked = 0
    for doc in objects[overlay]:
        if doc["apiVersion"].startswith(CRD_GROUPS):
            continue
        kubernetes_validate.validate(doc, "1.32", strict=True)
        checked += 1
    assert checked >= 25


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_has_the_designed_objects(objects, overlay):
    kinds = {(d["kind"], d["metadata"]["name"]) for d in objects[overlay]}
    for name in ("pdserve-gateway", "pdserve-prefill", "pdserve-decode"):
        assert ("Deployment", name) in kinds and ("Service", name) in kinds
        assert ("PodDisruptionBudget", name) in kinds and ("HorizontalPodAutoscaler", name) in kinds
    assert ("StatefulSet", "pdserve-redis") in kinds
    for secret in ("pdserve-redis", "pdserve-api-keys", "pdserve-public-tls", "pdserve-gateway-tls",
                   "pdserve-prefill-tls", "pdserve-decode-tls"):
        assert ("Secret", secret) in kinds or ("Certificate", secret) in kinds, secret
    for doc in objects[overlay]:
        if doc["kind"] == "Service" and doc["metadata"]["name"] in ("pdserve-prefill", "pdserve-decode"):
            assert doc["spec"]["clusterIP"] == "None"  # headless: the gateway picks workers itself


def test_gpu_overlay_requests_gpus_and_cpu_overlay_none(objects):
    for overlay, expect_gpu in (("cpu", False), ("gpu", True)):
        for doc, spec in pod_specs(objects[overlay]):
            if component(doc) not in ("prefill", "decode"):
                continue
            container = spec["containers"][0]
            assert ("nvidia.com/gpu" in container["resources"]["limits"]) == expect_gpu
            assert (env_value(container, "WORKER_DEVICE", {}) == "cuda") == expect_gpu
            if expect_gpu:
                assert spec["nodeSelector"] and spec["tolerations"]


# ------------------------------------------------------------------------------------------------- processes
def env_value(container: dict, name: str, config: dict[str, str]) -> str:
    for item in container.get("env", []):
        if item["name"] != name:
            continue
        if "value" in item:
            return item["value"]
        ref = item["valueFrom"]
        if "fieldRef" in ref:
            return {"status.podIP": "10.1.2.3", "metadata.name": "pod-0"}[ref["fieldRef"]["fieldPath"]]
        if "secretKeyRef" in ref:
            return "redis://:secret@pdserve-redis:6379/0" if ref["secretKeyRef"]["key"] == "url" else "secret"
        if "configMapKeyRef" in ref:
            return config[ref["configMapKeyRef"]["key"]]
    if any("configMapRef" in source for source in container.get("envFrom", [])) and name in config:
        return config[name]
    raise AssertionError(f"container {container['name']} has no env {name}")


def expanded_args(container: dict, config: dict[str, str]) -> list[str]:
    """The args as the kubelet passes them: $(VAR) replaced by the container's env."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env_value(container, m[1], config), arg)
            for arg in container["args"]]


def config_map(docs) -> dict[str, str]:
    return next(d["data"] for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "pdserve-config")


REDIS_URL_FROM_SECRET = {"secretKeyRef": {"name": "pdserve-redis", "key": "url"}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_command_parses_and_serves_the_ports_it_declares(objects, overlay, monkeypatch):
    config = config_map(objects[overlay])
    parser = build_parser()
    for doc, spec in pod_specs(objects[overlay]):
        if component(doc) == "redis":
            continue
        container = spec["containers"][0]
        args = parser.parse_args(expanded_args(container, config))
        declared = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        if component(doc) == "model-fetch":
            assert args.command == "fetch-model" and not declared
            continue
        served = {"grpc": args.port, "health": args.health_port, "metrics": args.metrics_port}
        # The Redis URL (with its password) comes from the Secret through the environment, never in the args.
        env = {item["name"]: item for item in container["env"]}
        assert env[cli_args.REDIS_URL_ENV]["valueFrom"] == REDIS_URL_FROM_SECRET
        assert args.redis_url is None and not any("redis" in arg.lower() for arg in container["args"])
        monkeypatch.setenv(cli_args.REDIS_URL_ENV, env_value(container, cli_args.REDIS_URL_ENV, config))
        if component(doc) == "gateway":
            served["http"] = args.http_port
            assert args.api_key_file and args.tls_cert and args.tls_key  # clients authenticate, over TLS
            process = cli_args.gateway_config(args)
        else:
            assert args.advertise_host == "10.1.2.3"  # registered under the pod IP
            role = component(doc)
            process = cli_args.worker_config(PrefillWorkerConfig if role == "prefill" else DecodeWorkerConfig,
                                             role, args)
        assert process.redis_url == "redis://:secret@pdserve-redis:6379/0"
        assert declared == served, doc["metadata"]["name"]
        assert args.cluster_ca and args.cluster_cert and args.cluster_key  # mutual TLS inside the cluster
        assert not args.insecure_internal
        mounts = [m["mountPath"] for m in container["volumeMounts"]]
        for path in (args.cluster_ca, args.cluster_cert, args.cluster_key):
            assert any(path.startswith(m + "/") for m in mounts), path
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == args.health_port, (doc["metadata"]["name"], probe)
        # Readiness follows the whole server ("": a gateway with no decode worker is NOT_SERVING); a gateway's
        # liveness asks its "liveness" service, which stays SERVING until the drain.
        assert container["readinessProbe"]["grpc"].get("service", "") == ""
        liveness = container["livenessProbe"]["grpc"].get("service", "")
        assert liveness == ("liveness" if component(doc) == "gateway" else ""), doc["metadata"]["name"]
        # The kubelet waits for the preStop pause and the drain before it kills the process.
        pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert spec["terminationGracePeriodSeconds"] >= pause + args.drain_timeout_s


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_resources_follow_threads(objects, overlay):
    config = config_map(objects[overlay])
    for doc, spec in pod_specs(objects[overlay]):
        if component(doc) not in ("prefill", "decode"):
            continue
        container = spec["containers"][0]
        args = build_parser().parse_args(expanded_args(container, config))
        resources = container["resources"]
        assert resources["requests"]["cpu"] == resources["limits"]["cpu"] == str(args.num_threads)
        assert resources["requests"]["memory"] == resources["limits"]["memory"]  # guaranteed QoS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_hardened(objects, overlay):
    for doc, spec in pod_specs(objects[overlay]):
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        for container in spec["containers"] + spec.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert "limits" in container["resources"]


# ------------------------------------------------------------------------------------------------- network
# Who may open a TCP connection to whom, on which port: the design's edges and nothing else.
EXPECTED_EDGES = {
    ("client", "gateway", 50051), ("client", "gateway", 8000),
    ("gateway", "prefill", 50061), ("gateway", "decode", 50071), ("prefill", "decode", 50071),
    ("gateway", "redis", 6379), ("prefill", "redis", 6379), ("decode", "redis", 6379),
    ("prometheus", "gateway", 9090), ("prometheus", "prefill", 9090), ("prometheus", "decode", 9090),
    ("model-fetch", "internet", 443),
    # The public ports admit any source (clients are anywhere); Prometheus's own egress is not ours to police.
    ("prometheus", "gateway", 50051), ("prometheus", "gateway", 8000),
}
OUTSIDE = ("client", "internet")
PEERS = {  # name -> (namespace labels, pod labels); None: outside the cluster
    "client": None, "internet": None,
    "prometheus": ({"kubernetes.io/metadata.name": "monitoring"}, {"app.kubernetes.io/name": "prometheus"}),
    **{c: ({"kubernetes.io/metadata.name": "pdserve"},
           {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": c}) for c in COMPONENTS},
}


def selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value = labels.get(expr["key"])
        if expr["operator"] == "In" and value not in expr["values"]:
            return False
        if expr["operator"] == "NotIn" and value in expr["values"]:
            return False
        if expr["operator"] == "Exists" and expr["key"] not in labels:
            return False
    return True


def peer_matches(rule_peers: list[dict] | None, peer: str) -> bool:
    if rule_peers is None:
        return True  # no from/to: any peer
    labels = PEERS[peer]
    for p in rule_peers:
        if "ipBlock" in p:
            if labels is None:
                return True
            continue
        if labels is None:
            continue
        ns_labels, pod_labels = labels
        ns_ok = selects(p["namespaceSelector"], ns_labels) if "namespaceSelector" in p \
            else ns_labels["kubernetes.io/metadata.name"] == "pdserve"
        pod_ok = selects(p["podSelector"], pod_labels) if "podSelector" in p else True
        if ns_ok and pod_ok:
            return True
    return False


def port_matches(rule_ports: list[dict] | None, port: int) -> bool:
    return rule_ports is None or any(p.get("port") == port and p.get("protocol", "TCP") == "TCP"
                                     for p in rule_ports)


def allowed(policies: list[dict], direction: str, pod: str, peer: str, port: int) -> bool:
    """Kubernetes semantics: isolated in `direction` if any policy selects the pod for it; then allowed if any
    rule of any such policy admits the peer and port."""
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    pod_labels = PEERS[pod][1] if PEERS[pod] else None
    if pod_labels is None:
        return True  # outside the cluster: not ours to police
    selecting = [p for p in policies if direction in p["spec"]["policyTypes"]
                 and selects(p["spec"]["podSelector"], pod_labels)]
    if not selecting:
        return True
    return any(peer_matches(rule.get(peers_key), peer) and port_matches(rule.get("ports"), port)
               for p in selecting for rule in p["spec"].get(key, []))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_admit_exactly_the_designed_edges(objects, overlay):
    policies = [d for d in objects[overlay] if d["kind"] == "NetworkPolicy"]
    ports = sorted({port for _, _, port in EXPECTED_EDGES} | {8081, 22, 53})
    edges = set()
    for src in PEERS:
        for dst in PEERS:
            if src == dst:
                continue
            for port in ports:
                if PEERS[src] is None and PEERS[dst] is None:
                    continue
                if src == "prometheus" and PEERS[dst] is None:
                    continue  # neither end is a pod of ours
                # Prometheus lives in its own namespace: only the ingress side is ours.
                egress_ok = src == "prometheus" or allowed(policies, "Egress", src, dst, port)
                if egress_ok and allowed(policies, "Ingress", dst, src, port):
                    edges.add((src, dst, port))
    # "client" and "internet" both stand for any outside address: named "client" as a source, "internet" as
    # a destination.
    edges = {(("client" if s in OUTSIDE else s), ("internet" if d in OUTSIDE else d), p) for s, d, p in edges}
    assert edges == EXPECTED_EDGES


def test_kubernetes_validate_catches_a_broken_object():
    """The schema check above can fail: a misspelt field is refused."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"replicas": 1, "selector": {"matchLabels": {"a": "b"}},
                    "template": {"metadata": {"labels": {"a": "b"}},
                                 "spec": {"containers": [{"name": "c", "image": "i", "imagePullPolcy": "x"}]}}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.32", strict=True)
