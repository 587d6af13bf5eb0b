"""`kvserve serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine
(`AsyncLLM`) or a cluster of replicas (`ClusterLLM`).

Every error a client can cause is answered in OpenAI's error JSON with a 4xx/503 status;
a client that disconnects has its request aborted before the engine's next step.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import secrets
import signal
import socket
import ssl
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kvserve
from kvserve.config import DEFAULT_MAX_REQUEST_BYTES
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    LoadLoRARequest,
    MigrateRequest,
    TokenizeRequest,
    UnloadLoRARequest,
)
from kvserve.entrypoints.openai.serving import ServingBackend, now, sse
from kvserve.entrypoints.openai.serving_chat import ChatServer
from kvserve.entrypoints.openai.serving_completions import CompletionServer
from kvserve.entrypoints.openai.serving_tokenization import TokenizationServer
from kvserve.errors import (
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
    ServerStoppingError,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1


@dataclass(frozen=True)
class ServerConfig:
    model_name: str  # the name responses carry
    aliases: tuple[str, ...] = ()  # more names requests may use (vLLM's further names)
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    tool_call_parser: str | None = None  # set: tool_choice "auto" finds calls with it
    reasoning_parser: str | None = None  # set: the thinking comes as reasoning_content
    shutdown_timeout: float = 0.0  # seconds requests in flight get to finish on SIGTERM/Ctrl+C
    # CORS: the origins whose browser pages may call the API ("*": any, as vLLM's default)
    allowed_origins: tuple[str, ...] = ("*",)
    access_log: bool = True  # a log line per HTTP request
    log_level: str = "info"  # uvicorn's
    # Seconds an idle keep-alive connection stays open: longer than clients keep theirs
    # (httpx and the OpenAI SDK 5, aiohttp 15, a cloud load balancer's 60), so that the client
    # always closes first. At uvicorn's default, 5, the server closed connections that a client
    # was reusing at that moment, and the request on it failed with a connection reset.
    timeout_keep_alive: int = 65
    # HTTPS: the PEM files of the server's private key and certificate (both, or neither)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None

    def __post_init__(self) -> None:
        """Checks the key and certificate load together, before a model does."""
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile: give both (the key and its "
                             "certificate) or neither")
        if self.ssl_certfile is not None:
            try:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                    self.ssl_certfile, self.ssl_keyfile)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"ssl_certfile and ssl_keyfile: cannot load them as a "
                                 f"certificate and its key: {e}") from None


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorInfo(message=str(self), type=self.kind,
                                             param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def whole_body_error(content_type: str, error: dict[str, Any]) -> str:
    """What is wrong with a body that is not a JSON object at all. FastAPI reads a body
    sent as a form (curl -d without a JSON Content-Type) as bytes, and its own error would
    say only that the input should be a dictionary."""
    if content_type and "json" not in content_type:
        return (f"the body must be a JSON object sent as application/json, and it came as "
                f"{content_type.split(';')[0]} (curl -d sends a form unless given "
                "-H 'Content-Type: application/json')")
    if error.get("type") == "missing":
        return "the body is empty: it must be a JSON object"
    kinds = {list: "an array", str: "a string", int: "a number", float: "a number",
             bool: "true or false", type(None): "null"}
    return (f"the body must be a JSON object, got "
            f"{kinds.get(type(error.get('input')), 'something else')}")


class RequestIdHeader:
    """Every response names its request in X-Request-Id, as OpenAI's API does: the client's
    own (vLLM's --enable-request-id-headers), for tracing it through proxies, or a fresh
    one. Plain ASGI: a stream's chunks pass untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id")
        header = (b"x-request-id", given or f"req-{uuid.uuid4().hex}".encode())

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_named)


class BodySizeLimit:
    """Answers 413 to request bodies over the limit, declared or streamed in chunks."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        if declared is not None:
            await self.app(scope, receive, send)
            return
        buffered: list[Message] = []
        size, more = 0, True
        while more:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
            if size > self.max_bytes:
                await self._reject(scope, receive, send)
                return

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body exceeds the limit of {self.max_bytes} bytes",
                         "invalid_request_error", code="request_too_large")
        await error.response()(scope, receive, send)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Runs `work`, cancelling it (which aborts its engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None


async def _until_disconnected(request: Request, events: AsyncIterator[str]
                              ) -> AsyncIterator[str]:
    """Relays server-sent events, stopping (and aborting) at the first step after the client
    has gone. A request that fails underneath ends with an error event, then `[DONE]`."""
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        async for event in events:
            if watcher.done():
                break
            yield event
    except RequestFailedError as e:
        error = ErrorInfo(message=str(e), type="server_error", code=e.code)
        yield sse({"error": error.model_dump()})
        yield sse("[DONE]")
    finally:
        watcher.cancel()
        await events.aclose()  # type: ignore[attr-defined]


def build_app(llm: ServingBackend, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="kvserve", version=kvserve.__version__)
    completions = CompletionServer(llm, config.model_name)
    chat = ChatServer(llm, config.model_name, config.tool_call_parser,
                      config.reasoning_parser)
    tokenization = TokenizationServer(llm, config.model_name)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_bytes)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        if first.get("type") == "json_invalid":
            return invalid(f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
                           ).response()
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if not loc:
            return invalid(whole_body_error(request.headers.get("content-type", ""),
                                            first)).response()
        param = ".".join(loc) or None
        message = first.get("msg")
        if first.get("type") == "value_error":  # a validator's own words, without pydantic's
            message = str(first.get("ctx", {}).get("error", message))
        return invalid(f"{param or 'body'}: {message}", param).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        message = str(e.detail)
        if e.status_code == 400:  # raised by FastAPI for bodies it cannot decode
            message = f"the body is not valid JSON in UTF-8: {message}"
        elif e.status_code == 404:
            message = (f"{request.method} {request.url.path}: no such route; this server "
                       f"has {', '.join(sorted(routes(app)))}")
        elif e.status_code == 405:
            allowed = {k.lower(): v for k, v in (e.headers or {}).items()}.get("allow")
            message = f"{request.method} {request.url.path}: use {allowed or 'another method'}"
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return APIError(e.status_code, message, kind, headers=e.headers).response()

    @app.exception_handler(ValueError)
    async def value_error(_: Request, e: ValueError) -> JSONResponse:
        message = str(e)
        return invalid(message, message.split(" ", 1)[0].rstrip(":") or None).response()

    @app.exception_handler(RequestFailedError)
    async def request_failed(_: Request, e: RequestFailedError) -> JSONResponse:
        return APIError(500, str(e), "server_error", code=e.code).response()

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return APIError(503, f"{e}; the server is stopping", "server_error",
                        code="engine_dead").response()

    @app.exception_handler(ServerStoppingError)
    async def stopping(_: Request, e: ServerStoppingError) -> JSONResponse:
        return APIError(503, str(e), "server_error", code=e.code).response()

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(_: Request, e: EngineOverloadedError) -> JSONResponse:
        return APIError(503, str(e), "server_overloaded", code="overloaded",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)}).response()

    @app.middleware("http")
    async def authorize(request: Request, call_next: Any) -> Response:
        if config.api_key and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            if not secrets.compare_digest(header.encode(), f"Bearer {config.api_key}".encode()):
                return APIError(401, "a valid API key is required (Authorization: Bearer ...)",
                                "authentication_error", code="invalid_api_key").response()
        return await call_next(request)

    if config.allowed_origins:
        # Outside the key check: a browser's preflight is answered before it (it carries no
        # key), and every response, a 401 too, carries the headers that let the page read it.
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(RequestIdHeader)  # outermost: a 401 or a preflight is named too

    names = (config.model_name, *config.aliases)

    def check_model(name: str | None) -> None:
        if name is not None and name not in names and name not in llm.lora_names:
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                                f"{sorted({*names, *llm.lora_names})}",
                           "invalid_request_error", "model", "model_not_found")

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's) name for it
    async def health() -> Response:
        if llm.dead is not None:
            raise llm.dead
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvserve.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await llm.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/replicas")
    async def replicas() -> list[dict[str, Any]]:
        return llm.describe()

    @app.post("/replicas/migrate")
    async def migrate(body: MigrateRequest) -> list[dict[str, Any]]:
        return await llm.migrate(body.source, body.destination, body.num_requests)

    def model_cards() -> list[dict[str, Any]]:
        base = {"object": "model", "created": now(), "owned_by": "kvserve",
                "max_model_len": llm.inputs.max_model_len}
        return [{"id": name, **base} for name in names] + [
            {"id": name, "parent": config.model_name, **base} for name in sorted(llm.lora_names)]

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": model_cards()}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict[str, Any]:
        """OpenAI's `client.models.retrieve(name)`; a model's name may hold slashes."""
        check_model(model)
        return next(card for card in model_cards() if card["id"] == model)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest) -> Response:
        await llm.load_lora_adapter(body.lora_name, body.lora_path)
        return Response(f"loaded LoRA adapter {body.lora_name!r}", status_code=200)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest) -> Response:
        if body.lora_name not in llm.lora_names:
            raise APIError(404, f"lora_name {body.lora_name!r} is not a loaded adapter",
                           "invalid_request_error", "lora_name", "model_not_found")
        await llm.unload_lora_adapter(body.lora_name)
        return Response(f"unloaded LoRA adapter {body.lora_name!r}", status_code=200)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        return tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        check_model(body.model)
        return tokenization.detokenize(body)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return tokenization.tokenizer_info()

    async def respond(server: CompletionServer | ChatServer,
                      body: CompletionRequest | ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        if body.model in llm.lora_names:
            body._lora_name = body.model
        if body.stream:
            events = server.stream(body)  # type: ignore[arg-type]
            return StreamingResponse(_until_disconnected(request, events),
                                     media_type="text/event-stream")
        return await _unless_disconnected(request, server.full(body))  # type: ignore[arg-type]

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Any:
        return await respond(completions, body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
        return await respond(chat, body, request)

    return app


def routes(app: FastAPI) -> set[str]:
    """The routes a client may call, each as `METHOD /path`."""
    return {f"{method} {route.path.replace(':path}', '}')}" for route in app.routes
            if isinstance(route, APIRoute) for method in route.methods}


def serve(llm: ServingBackend, config: ServerConfig, host: str, port: int) -> None:
    url = f"{'https' if config.ssl_certfile else 'http'}://{host}:{port}"
    auth = ' -H "Authorization: Bearer $KVSERVE_API_KEY"' if config.api_key else ""
    print(f"kvserve: serving {config.model_name!r} at {url}/v1\n"
          f"try:  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
          f"-d '{{\"model\": \"{config.model_name}\", \"prompt\": \"def fibonacci(n):\", "
          f"\"max_tokens\": 32}}'", flush=True)
    if llm.inputs.sampling_defaults:
        logger.info("requests that leave these sampling fields out get the generation "
                    "config's values: %s (--generation-config vllm: none)",
                    json.dumps(llm.inputs.sampling_defaults))
    # Everything loaded so far (torch, transformers, the model) lives as long as the server:
    # keep it out of the collector, whose full passes over it would hold the GIL for
    # 100+ ms and stall the HTTP loop. Unfrozen at the end, so that the interpreter's last
    # collection frees it: frozen, Triton's bindings (torch imports Triton where it is
    # installed) reported their objects as leaked in some 40 lines at every shutdown.
    gc.collect()
    gc.freeze()
    # uvicorn stops gracefully on SIGTERM (docker stop, systemd, kill), then raises it again
    # through the handler it found: with the default one the process died there, before the
    # engine's shutdown, and tensor-parallel workers printed tracebacks as their pipes closed.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    server = _DrainingServer(uvicorn_config(build_app(llm, config), config, host, port), llm,
                             config.shutdown_timeout)
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl+C, raised again once the server has stopped
        pass
    finally:
        llm.shutdown()
        gc.unfreeze()
    if llm.dead is not None:  # a failure, for the supervisor to restart the server
        raise SystemExit(f"kvserve: {llm.dead}")


def uvicorn_config(app: FastAPI, config: ServerConfig, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=config.log_level,
                          access_log=config.access_log,
                          timeout_keep_alive=config.timeout_keep_alive,
                          ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # the status a shell reports for a SIGTERM'd process


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, whose stop (SIGTERM or Ctrl+C) gives the requests in flight
    `shutdown_timeout` seconds, then ends them with an error: a stream's last event or a 503.
    Left to uvicorn, a stop waited for every open stream to finish, however long. It also
    stops by itself once the engine is dead, where it used to answer /health with 200 and
    fail every request."""

    def __init__(self, config: uvicorn.Config, llm: ServingBackend,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.llm, self.shutdown_timeout = llm, shutdown_timeout

    async def on_tick(self, counter: int) -> bool:
        if self.llm.dead is not None and not self.should_exit:
            logger.error("stopping the server: %s", self.llm.dead)
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        error = ServerStoppingError(
            f"the server is shutting down (--shutdown-timeout {self.shutdown_timeout:g} s "
            f"passed before this request finished); retry it")
        asyncio.get_running_loop().call_later(self.shutdown_timeout, self.llm.fail_streams,
                                              error)
        await super().shutdown(sockets)
