"""Run one stage worker: load the stage's layers, connect to the storage pods, serve the API."""

from __future__ import annotations

import faulthandler
import json
import logging
import signal

import torch

from cacheflow_common.model.sources import load_model, parse_dtype
from cacheflow_common.restore.profile import Profile
from cacheflow_services.http_server import http_server, listen
from cacheflow_services.worker.app import create_app
from cacheflow_services.worker.config import WorkerConfig
from cacheflow_services.worker.engine import StageEngine
from cacheflow_services.worker.next_stage import NextStage
from cacheflow_services.worker.trust import GrantedStores, WorkerTrust

log = logging.getLogger(__name__)
FRAME_SLACK_BYTES = 8 << 20  # metadata (token ids) beside the hidden states
JSON_BYTES_PER_TOKEN = 12  # a restore's JSON: a token id's digits, its comma and room to spare
JSON_SLACK_BYTES = 64 << 10  # the rest of a restore's fields (a delivery grant included)


def serve(config: WorkerConfig, trust: WorkerTrust) -> None:
    """Serve the stage's API: only to holders of the internal token, and work only on the coordinator's
    grants; storage credentials come with the grants (the worker holds no tenant's token)."""
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack to the log
    model = load_model(config.model, dtype=parse_dtype(config.dtype), layers=config.layers)
    profile = Profile.load(config.profile, model=model) if config.profile else None  # refused if not ours
    next_stage = NextStage(config.next_stage, timeout_s=config.next_stage_timeout_s,
                           internal_token=trust.internal_token, tls=config.tls) if config.next_stage else None
    stores = GrantedStores(config.pods, replicas=config.replicas,
                           tls=config.tls.client_context() if config.tls else None)
    engine = StageEngine(config, model, stores, profile, next_stage, spent=trust.spent)
    engine.metrics.pool_capacity_blocks.set(engine.pool.capacity_blocks)
    max_body = config.max_request_tokens * model.config.hidden_size * 4 + FRAME_SLACK_BYTES
    max_json = config.max_request_tokens * JSON_BYTES_PER_TOKEN + JSON_SLACK_BYTES
    http = listen(config.host, config.http_port)
    app = create_app(engine, max_body_bytes=max_body, max_json_bytes=max_json, trust=trust, stores=stores)
    server = http_server(app, tls=config.tls, limits=config.limits)
    ready = {"event": "ready", "stage": config.stage, "http_port": http.getsockname()[1], "tls": config.tls is not None,
             "layers": [config.layers.start, config.layers.stop], "threads": torch.get_num_threads()}
    print(json.dumps(ready), flush=True)  # one line that launchers and tests wait for
    try:
        server.run(sockets=[http])  # returns on SIGINT/SIGTERM
    finally:
        engine.close()
