"""Run the coordinator: connect to the stage workers, load the tokenizer, serve the API."""

from __future__ import annotations

import json
import logging

from cacheflow_services.coordinator.app import create_app
from cacheflow_services.coordinator.cluster import Cluster
from cacheflow_services.coordinator.config import CoordinatorConfig
from cacheflow_services.coordinator.service import Coordinator
from cacheflow_services.coordinator.tokenizer import TextCodec
from cacheflow_services.http_server import DEFAULT_LIMITS, ServerLimits, http_server, listen

log = logging.getLogger(__name__)
SPARE_THREADS = 32  # beyond the queue and the running batch: health, metrics, status calls


def serve(config: CoordinatorConfig, *, connect_wait_s: float = 180.0, limits: ServerLimits = DEFAULT_LIMITS) -> None:
    cluster = Cluster(config)
    model = cluster.connect(wait_s=connect_wait_s)
    codec = TextCodec(config.tokenizer) if config.tokenizer else None
    coordinator = Coordinator(config, cluster, model)
    # every waiting request holds a worker thread: make room for a full queue and the running batch
    app = create_app(coordinator, codec, threads=config.max_queue + config.max_batch + SPARE_THREADS)

    http = listen(config.host, config.http_port)
    server = http_server(app, limits=limits)  # the public API: plain HTTP (TLS ends in front of it)
    ready = {"event": "ready", "http_port": http.getsockname()[1], "stages": len(config.stages),
             "chunk_size": model.chunk_size, "model": config.model_name}
    print(json.dumps(ready), flush=True)  # one line that launchers and tests wait for
    try:
        server.run(sockets=[http])  # returns on SIGINT/SIGTERM
    finally:
        coordinator.close()
        cluster.close()
