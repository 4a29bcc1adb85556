"""The ASGI app of `layerbus serve`: the Files and Batch routes, the dashboard, OpenAI-shaped errors, the body
limit, and the keeper started and stopped with the app."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from layerbus.serve import batches_api, dashboard, files_api
from layerbus.serve.batch_keeper import BatchKeeper
from layerbus.serve.body_limit import BodyLimit
from layerbus.serve.errors import install_error_handlers
from layerbus.serve.server import Server


def create_app(server: Server, announce: str | None = None) -> BodyLimit:
    """The app over `server`; `announce` is printed to stderr once it is ready for requests."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        keeper = BatchKeeper(server)
        keeper.start()
        if announce:
            print(announce, file=sys.stderr, flush=True)
        try:
            yield
        finally:
            keeper.stop()
            server.close()

    app = FastAPI(title="layerbus", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    install_error_handlers(app)
    app.include_router(files_api.router)
    app.include_router(batches_api.router)
    app.include_router(dashboard.router)
    config = server.config
    return BodyLimit(app, config.max_body_bytes, "/v1/files", config.max_file_bytes)
