"""The worker's route table: every route a worker app serves is declared with its credential, every `/v1`
route needs a grant, and an app with an undeclared route is refused (the worker would not start)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI

from cacheflow_services.worker.routes import ROUTES, Credential, check_routes, route_of, routes_without_grant


def test_every_v1_route_needs_a_grant_for_its_own_operation():
    assert routes_without_grant() == []
    granted = [r for r in ROUTES if r.credential is Credential.GRANT]
    assert {r.path for r in ROUTES if r.credential is Credential.PUBLIC} == {"/healthz", "/readyz", "/metrics"}
    assert len({r.op for r in granted}) == len(granted)  # a grant for one route's operation opens no other
    assert route_of("GET", "/v1/requests/r1/kv").op == "read"  # type: ignore[union-attr]
    assert route_of("DELETE", "/v1/requests/r1").op == "release"  # type: ignore[union-attr]
    assert route_of("GET", "/v1/restore") is None and route_of("POST", "/v1/nothing") is None


def test_an_app_with_a_route_missing_from_the_table_is_refused():
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # as the worker builds it
    for route in ROUTES:
        app.add_api_route(route.path, lambda: None, methods=[route.method])
    check_routes(app)  # every route declared: fine
    app.add_api_route("/v1/debug/dump", lambda: None, methods=["GET"])
    with pytest.raises(RuntimeError, match="GET /v1/debug/dump"):
        check_routes(app)
