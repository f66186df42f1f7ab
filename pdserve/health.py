"""grpc.health.v1 checks: what the launcher waits on and what `pdserve health` (Docker, Kubernetes) runs.

Every pdserve server (gateway, prefill and decode workers) reports SERVING for the empty service name once it
is ready to take requests, and NOT_SERVING while it drains; the gateway's "liveness" service stays SERVING
until the drain.

A check reaches the port the way its clients do: plaintext (a --health-port, or a server without TLS), mutual
TLS with a cluster certificate (`Credentials.cluster`: a worker's port; a `probe` certificate may call health
and Stats only, protos.tls.cluster_role_table) or server TLS (`Credentials.public`: the gateway's public port).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.tls import TlsFiles, channel_credentials, channel_options, public_channel_credentials

SERVING = "SERVING"


@dataclass(frozen=True)
class Credentials:
    """How to reach a server that is not plaintext."""
    channel: grpc.ChannelCredentials
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def cluster(cls, files: TlsFiles, server_role: str | None = None) -> Credentials:
        """Mutual TLS with `files`; with `server_role` the server must hold a certificate of that role (checked
        as its TLS host name, whatever address is dialed), else it is checked against the address dialed."""
        return cls(channel_credentials(files), tuple(channel_options(server_role)) if server_role else ())

    @classmethod
    def public(cls, ca_path: str | None = None) -> Credentials:
        """Server TLS against `ca_path` (PEM bundle), else the system's roots."""
        return cls(public_channel_credentials(ca_path))


def status(target: str, service: str = "", timeout: float = 2.0, credentials: Credentials | None = None) -> str:
    """The serving status of `service` at `target` ("host:port"): "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN",
    "UNKNOWN", or, when the check itself failed, the gRPC status code name ("UNAVAILABLE" for a failed
    connection or TLS handshake, "DEADLINE_EXCEEDED", "UNIMPLEMENTED" for a server without the health service,
    "UNAUTHENTICATED"/"PERMISSION_DENIED" for a certificate the server refuses, ...)."""
    if credentials is None:
        channel = grpc.insecure_channel(target)
    else:
        channel = grpc.secure_channel(target, credentials.channel, options=list(credentials.options))
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # the health servicer's answer for an unknown service
                return "SERVICE_UNKNOWN"
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def check(target: str, service: str = "", timeout: float = 2.0, credentials: Credentials | None = None) -> bool:
    """True when `service` at `target` answers SERVING within `timeout` seconds."""
    return status(target, service, timeout, credentials) == SERVING
