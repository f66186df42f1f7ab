"""grpc.health.v1 checks: what the launcher waits on and what `pdserve health` (Docker, Kubernetes) runs.

Every pdserve server (gateway, prefill and decode workers) reports SERVING for the empty service name once it
is ready to take requests, and NOT_SERVING while it drains.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = "SERVING"


def status(target: str, service: str = "", timeout: float = 2.0) -> str:
    """The serving status of `service` at `target` ("host:port"): "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN",
    "UNKNOWN", or, when the check itself failed, the gRPC status code name ("UNAVAILABLE", "DEADLINE_EXCEEDED",
    "UNIMPLEMENTED" for a server without the health service, ...)."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # the health servicer's answer for an unknown service
                return "SERVICE_UNKNOWN"
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def check(target: str, service: str = "", timeout: float = 2.0) -> bool:
    """True when `service` at `target` answers SERVING within `timeout` seconds."""
    return status(target, service, timeout) == SERVING
