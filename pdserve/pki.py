"""The files a deployment's processes authenticate with, made by `pdserve certs` and by `pdserve up`.

    write_cluster_files(out, identities, hosts)   a cluster CA and one certificate per process (protos.tls
                                                  layout: ca.pem, ca-key.pem, <name>.pem, <name>-key.pem), plus
                                                  the gateway's public TLS pair from a CA of its own
                                                  (public-ca.pem, public.pem, public-key.pem)
    write_k8s_secrets(out)                        exactly the files deploy/k8s/overlays/*/kustomization.yaml's
                                                  secretGenerators read, with a generated Redis password and
                                                  API key
    write_compose_secrets(out)                    the same material split by who may read it, one folder per
                                                  docker-compose volume: gateway/, prefill/, decode/, redis/

Why a second CA for the public certificate: every certificate the cluster CA signs carries a role identity
that workers accept, so a public certificate from it, once installed on a load balancer or handed to a client
team, would also open the internal RPCs. Clients trust public-ca.pem; workers never see it.

Keys, passwords and the API key file are written 0600, certificates 0644, directories 0700; every file is
created with its final mode and replaced atomically. Existing files are overwritten (a rotation): issuing
under the same CA (`ca`) keeps the processes that still hold older certificates in the cluster.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from gateway.auth import parse_api_keys
from protos.tls import ClusterCA, Identity, TlsFiles, write_cluster_pki, write_file

DEFAULT_IDENTITIES = (("gateway", "gateway"), ("prefill", "prefill"), ("decode", "decode"), ("probe", "probe"))
"""What `pdserve certs --out` issues without --name: one certificate per role, named after it."""
K8S_ROLE_NAME = "pool"
"""Every pod of a Kubernetes role shares its role's certificate: spiffe://pdserve/<role>/pool (as the
cert-manager component's Certificates)."""
K8S_REDIS_HOST = "pdserve-redis:6379"
K8S_PUBLIC_HOSTS = ("pdserve-gateway", "pdserve-gateway.pdserve", "pdserve-gateway.pdserve.svc",
                    "pdserve-gateway.pdserve.svc.cluster.local")
K8S_FILES = ("redis-password", "redis-url", "api-keys", "public.crt", "public.key", "ca.crt", "gateway.crt",
             "gateway.key", "prefill.crt", "prefill.key", "decode.crt", "decode.key")
"""The files the overlays' secretGenerators read."""


@dataclass(frozen=True)
class PublicTls:
    """The gateway's public TLS pair and the CA that clients verify it with."""
    cert_path: Path
    key_path: Path
    ca_path: Path


def parse_identity(text: str) -> tuple[str, str]:
    """ROLE/NAME (or ROLE alone, named after the role) as a (role, name) pair; ValueError when invalid."""
    role, _, name = text.partition("/")
    identity = Identity(role, name or role)
    return identity.role, identity.name


def write_public_tls(directory: Path, hosts: Iterable[str] = ()) -> PublicTls:
    """public-ca.pem, public.pem and public-key.pem in `directory`: a server certificate for the gateway's
    public ports (localhost, 127.0.0.1, ::1 and `hosts`), from a CA of its own."""
    ca = ClusterCA.generate(common_name="pdserve gateway public CA")
    issued = ca.issue("gateway", "public", hosts=hosts)
    files = PublicTls(directory / "public.pem", directory / "public-key.pem", directory / "public-ca.pem")
    write_file(files.ca_path, ca.cert_pem, 0o644)
    write_file(files.cert_path, issued.cert_pem, 0o644)
    write_file(files.key_path, issued.key_pem, 0o600)
    return files


def write_cluster_files(directory: str | os.PathLike, identities: Iterable[tuple[str, str]] = DEFAULT_IDENTITIES,
                        hosts: Iterable[str] = (), ca: ClusterCA | None = None
                        ) -> tuple[dict[str, TlsFiles], PublicTls]:
    """The cluster PKI (name -> files; a fresh CA unless `ca`) and the gateway's public TLS pair in `directory`.
    `hosts`: extra DNS names and IP addresses every certificate carries (where processes are dialed)."""
    directory = Path(directory)
    hosts = list(hosts)
    identities = list(identities)
    if any(name.startswith("public") for _, name in identities):
        raise ValueError("process names starting with 'public' would overwrite the gateway's public TLS files")
    files = write_cluster_pki(directory, identities, ca=ca, hosts=hosts)
    return files, write_public_tls(directory, hosts)


def generate_api_key() -> str:
    return secrets.token_urlsafe(32)


def write_k8s_secrets(directory: str | os.PathLike, redis_password: str | None = None,
                      api_key: str | None = None, public_hosts: Iterable[str] = ()) -> dict[str, Path]:
    """K8S_FILES in `directory` (created 0700): a fresh cluster CA with one certificate per role
    (spiffe://pdserve/<role>/pool), the gateway's public pair (public.crt/.key, for the in-cluster Service names
    and `public_hosts`; its CA in public-ca.crt, for clients), the Redis password and the URL that carries it,
    and an API key file with one key (tenant "default"). Also ca.key, to issue more certificates later.
    Returns file name -> path."""
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    ca = ClusterCA.generate()
    out: dict[str, Path] = {}

    def put(name: str, data: bytes, mode: int) -> None:
        out[name] = directory / name
        write_file(out[name], data, mode)

    put("ca.crt", ca.cert_pem, 0o644)
    put("ca.key", ca.key_pem, 0o600)
    for role in ("gateway", "prefill", "decode"):
        issued = ca.issue(role, K8S_ROLE_NAME)
        put(f"{role}.crt", issued.cert_pem, 0o644)
        put(f"{role}.key", issued.key_pem, 0o600)
    public_ca = ClusterCA.generate(common_name="pdserve gateway public CA")
    public = public_ca.issue("gateway", "public", hosts=[*K8S_PUBLIC_HOSTS, *public_hosts])
    put("public-ca.crt", public_ca.cert_pem, 0o644)
    put("public.crt", public.cert_pem, 0o644)
    put("public.key", public.key_pem, 0o600)
    password = redis_password or secrets.token_urlsafe(32)
    put("redis-password", password.encode(), 0o600)
    put("redis-url", f"redis://:{quote(password, safe='')}@{K8S_REDIS_HOST}/0".encode(), 0o600)
    put("api-keys", f"{api_key or generate_api_key()} default\n".encode(), 0o600)
    return out


COMPOSE_REDIS_HOST = "redis:6379"
COMPOSE_PUBLIC_HOSTS = ("localhost", "gateway")


def write_compose_secrets(directory: str | os.PathLike, public_hosts: Iterable[str] = (),
                          redis_password: str | None = None, api_key: str | None = None) -> dict[str, Path]:
    """One folder per docker-compose volume under `directory`, each holding only what its service reads:

        gateway/   ca.pem tls.pem tls-key.pem (cluster, role gateway), public.pem public-key.pem public-ca.pem
                   (public TLS for localhost, "gateway" and `public_hosts`), api-keys, redis-url
        prefill/   ca.pem tls.pem tls-key.pem (role prefill), redis-url
        decode/    ca.pem tls.pem tls-key.pem (role decode), redis-url
        redis/     redis.conf (requirepass), password (for the healthcheck's redis-cli)

    Returns "<folder>/<file>" -> path."""
    directory = Path(directory)
    ca = ClusterCA.generate()
    password = redis_password or secrets.token_urlsafe(32)
    redis_url = f"redis://:{quote(password, safe='')}@{COMPOSE_REDIS_HOST}/0".encode()
    out: dict[str, Path] = {}

    def put(folder: str, name: str, data: bytes, mode: int) -> None:
        path = directory / folder / name
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_file(path, data, mode)
        out[f"{folder}/{name}"] = path

    for role in ("gateway", "prefill", "decode"):
        issued = ca.issue(role, role)
        put(role, "ca.pem", ca.cert_pem, 0o644)
        put(role, "tls.pem", issued.cert_pem, 0o644)
        put(role, "tls-key.pem", issued.key_pem, 0o600)
        put(role, "redis-url", redis_url, 0o600)
    public_ca = ClusterCA.generate(common_name="pdserve gateway public CA")
    public = public_ca.issue("gateway", "public", hosts=[*COMPOSE_PUBLIC_HOSTS, *public_hosts])
    put("gateway", "public-ca.pem", public_ca.cert_pem, 0o644)
    put("gateway", "public.pem", public.cert_pem, 0o644)
    put("gateway", "public-key.pem", public.key_pem, 0o600)
    put("gateway", "api-keys", f"{api_key or generate_api_key()} default\n".encode(), 0o600)
    put("redis", "redis.conf", f'requirepass "{password}"\n'.encode(), 0o600)
    put("redis", "password", password.encode(), 0o600)
    return out


def first_api_key(path: str | os.PathLike) -> str:
    """The first key of an API key file (gateway.auth's format, validated as the gateway would)."""
    text = Path(path).read_text()
    parse_api_keys(text, str(path))
    return next(fields[0] for fields in map(str.split, text.splitlines()) if fields and not fields[0].startswith("#"))
