"""The gateway's operations ports beside its public APIs, both plaintext and on the gateway's host:

    health_port    grpc.health.v1 and nothing else, answered by the public server's HealthServicer (the same
                   statuses: "", pdserve.v1.Generation, liveness; NOT_SERVING from the start of a drain), for
                   the kubelet's native gRPC probes while the public port needs TLS and an API key
    metrics_port   GET /metrics: the gateway's registry (gateway.metrics), as the HTTP API's /metrics serves it

Both run on the gateway's event loop; `close` stops them, last in a drain so probes see NOT_SERVING.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST


class OpsPorts:
    """The started health-only gRPC server and /metrics HTTP app; a port is None when not configured."""

    def __init__(self) -> None:
        self._health: grpc.aio.Server | None = None
        self._runner: web.AppRunner | None = None
        self.health_port: int | None = None
        self.metrics_port: int | None = None

    async def start(self, host: str, health_port: int | None, health_servicer: health.aio.HealthServicer,
                    metrics_port: int | None, render_metrics: Callable[[], Awaitable[bytes]]) -> None:
        """Bind the configured ports (0 picks a free one); on failure nothing stays open."""
        try:
            if health_port is not None:
                self._health = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
                health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self._health)
                self.health_port = self._health.add_insecure_port(f"{host}:{health_port}")
                if self.health_port == 0:
                    raise OSError(f"cannot bind {host}:{health_port}")
                await self._health.start()
            if metrics_port is not None:
                async def metrics(request: web.Request) -> web.Response:
                    return web.Response(body=await render_metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST})

                app = web.Application()
                app.add_routes([web.get("/metrics", metrics)])
                self._runner = web.AppRunner(app, access_log=None)
                await self._runner.setup()
                await web.TCPSite(self._runner, host.strip("[]") or None, metrics_port).start()
                self.metrics_port = self._runner.addresses[0][1]
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._health is not None:
            await self._health.stop(0)
            self._health = None
