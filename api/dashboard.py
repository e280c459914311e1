"""GET /dashboard: one self-contained page (api/dashboard.html: its CSS, script and plot inline, nothing from
elsewhere, so it works air-gapped) that shows what the conversation cache holds; and GET /requests, the last
finished requests it reads beside /cache, /slots, /metrics and /v1/models.

The page itself carries no data and answers without the API key (a browser cannot put a bearer token on a
page load); every request the page makes for data sends the key the operator types into it (kept in the
tab's sessionStorage; ``/dashboard#key=KEY`` also works and the key never reaches the server's logs), and
those routes are behind --api-key like the rest of the API.
"""
from __future__ import annotations

from importlib import resources

from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from api.errors import bad_request
from scheduler.request_history import MAX_REQUESTS

OPEN_PATHS = ("/dashboard",)


def _page() -> str:
    return resources.files("api").joinpath("dashboard.html").read_text(encoding="utf-8")


def create_routes(endpoint) -> list[Route]:
    """The routes, wrapped by the server's `endpoint` (request id, API key, error objects)."""
    page = _page()  # read once: the page is static

    @endpoint(while_loading=True)
    async def dashboard(state, http_request, request_id) -> Response:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache",
                                           "Content-Security-Policy": "default-src 'self'; "
                                           "script-src 'unsafe-inline'; style-src 'unsafe-inline'"})

    @endpoint
    async def requests(state, http_request, request_id) -> Response:
        """The last finished requests, newest first: ?conversation=KEY keeps one conversation's turns,
        ?limit=N (1..256, default 256) the newest N."""
        params = http_request.query_params
        try:
            limit = int(params.get("limit", MAX_REQUESTS))
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_REQUESTS:
            raise bad_request(f"limit must be an integer from 1 to {MAX_REQUESTS}, got {params.get('limit')!r}",
                              param="limit")
        found = state.engine.requests_snapshot(params.get("conversation"), limit)
        return JSONResponse({"requests": found})

    return [Route("/dashboard", dashboard, methods=["GET"]), Route("/requests", requests, methods=["GET"])]
