"""Run one storage pod: the data plane in background threads, the control API in the main thread."""

from __future__ import annotations

import json
import logging
from typing import Any

from cacheflow_common.errors import ConfigError
from cacheflow_common.tls import TLSFiles
from cacheflow_common.transport.shaping import TokenBucket
from cacheflow_services.http_server import DEFAULT_LIMITS, ServerLimits, http_server, listen
from cacheflow_services.storage.app import create_app
from cacheflow_services.storage.config import StorageConfig
from cacheflow_services.storage.dataplane import DataPlaneServer
from cacheflow_services.storage.pod import StoragePod

log = logging.getLogger(__name__)


def open_nixl(transport: str, name: str) -> Any:
    """The pod's NIXL endpoint when asked for ("nixl"), else None: TCP only; ConfigError when NIXL was
    asked for and cannot start. "auto" serves TCP: the cluster's own readers (stage workers, the vLLM
    connector) read over TCP, which also measured at least as fast on loopback (`cacheflow bench storage`);
    NIXL is for readers that bring an endpoint of their own."""
    if transport != "nixl":
        return None
    try:
        from cacheflow_common.transport.nixl_plane import NixlPodEndpoint

        return NixlPodEndpoint(name)
    except Exception as exc:  # ImportError, or a UCX/NIXL failure to start: both mean "no NIXL here"
        raise ConfigError(f"NIXL transport requested but unavailable: {exc}") from exc


def serve(config: StorageConfig, *, tls: TLSFiles | None = None, limits: ServerLimits = DEFAULT_LIMITS) -> None:
    """`tls`: the data plane serves TLS to the clients that ask for it; the control API (probes, metrics,
    existence queries) stays plain HTTP."""
    pod = StoragePod(config)
    data = DataPlaneServer(pod, TokenBucket(config.rate_bytes_per_s), None,
                           tls=tls.server_context() if tls is not None else None)
    data.nixl = open_nixl(config.transport, f"cacheflow-storage-{data.port}")
    transport = "nixl" if data.nixl is not None else "tcp"
    data.start()
    http = listen(config.host, config.http_port)
    app = create_app(pod, data_port=data.port, transport=transport)
    server = http_server(app, limits=limits)
    ready = {"event": "ready", "data_port": data.port, "http_port": http.getsockname()[1], "transport": transport,
             "backend": config.backend}
    print(json.dumps(ready), flush=True)  # one line that launchers and tests wait for
    try:
        server.run(sockets=[http])  # returns on SIGINT/SIGTERM
    finally:
        data.shutdown()
        data.server_close()
