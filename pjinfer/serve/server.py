"""An OpenAI-compatible HTTP server over one loaded Engine (`pjinfer serve`).

Endpoints: GET /health ({"status", "active", "waiting"}), GET /v1/models, POST /v1/completions, POST
/v1/chat/completions (messages rendered with the model's chat template; the reply stops at its end-of-turn; a
message's content is a string or a list of text parts, {"type": "text", "text": ...}, joined with newlines).

Request fields, the defaults of those left unset, the OpenAI fields refused and those ignored: `bodies.py`.
Responses carry usage and finish_reason: "length" at max_tokens, "stop" at an end-of-text token or a stop string,
"shutdown" when the server was stopped (SIGTERM/SIGINT) while the request was decoding.

Every error is an OpenAI-style JSON object {"error": {"message", "type", "param", "code"}} with its HTTP status:
400 bad JSON, bad values, an unsupported field or a prompt past the context; 401 a missing or wrong API key (when
one is set); 404 an unknown model or path; 413 a body over the size limit; 422 a body of the wrong shape; 429 (with
Retry-After) every place in the batch and in the waiting queue taken; 503 shutting down.

Requests run on `scheduler.Scheduler` (one thread owns the engine; every active request advances a token per round,
in one batched step on the host decode). Up to max_active requests decode at once, up to max_queue more wait. A
client that disconnects, streaming or not, leaves the queue at once or the batch at the next decode step, with one
log line ("client went away after N tokens"). One log line per finished request: id, tokens in and out, time to
first token, decode rate.
"""
from __future__ import annotations

import asyncio
import errno
import hmac
import json
import logging
import secrets
import signal
import socket
import threading
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pjinfer.config import ConfigError
from pjinfer.runtime.sampling import Sampling, choose_seed
from pjinfer.serve.bodies import (DEFAULT_SAMPLING, ApiError, ChatRequest, CompletionRequest, check_fields,
                                  message_text)
from pjinfer.serve.scheduler import Job, QueueFull, Scheduler, SchedulerClosed

log = logging.getLogger("pjinfer.serve.server")
MAX_BODY_BYTES = 1 << 20
MAX_QUEUE = 32          # requests that may wait for a place in the batch (--max-queue); past it: 429
RETRY_AFTER_S = 1       # the Retry-After of a 429

# ---------------------------------------------------------------- the app
async def _drain(receive, budget: int) -> None:
    """Reads and drops the rest of a request's body, up to `budget` bytes. A 413 goes out after the body it refuses
    has been read (up to twice the limit): a server that closes the connection with the body still arriving makes
    the client's kernel see a reset, which can lose the 413 before the client reads it."""
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class _Guard:
    """ASGI middleware that refuses, before any handler runs, a /v1/ request without the API key (when one is set)
    and a body whose Content-Length is over the limit (a chunked body is measured as it is read, in Server._parse).
    A refused body up to twice the limit is read and dropped first (`_drain`); a longer one is not read at all.
    Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would pass every streamed chunk through an extra
    task and memory stream."""

    def __init__(self, app, server: "Server"):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            request = Request(scope)
            try:
                if request.url.path.startswith("/v1/"):
                    self.server.check_key(request)
                length = request.headers.get("content-length")
                limit = self.server.max_body_bytes
                if length is not None and length.isdigit() and int(length) > limit:
                    if int(length) <= 2 * limit:
                        await _drain(receive, 2 * limit)
                    raise ApiError(413, f"request body over {limit} bytes")
            except ApiError as e:
                await e.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Server:
    """Holds the engine's scheduler and builds the FastAPI app. `name` is the model id clients send."""

    def __init__(self, engine, *, name: str | None = None, api_key: str | None = None, max_active: int = 8,
                 max_queue: int = MAX_QUEUE, max_body_bytes: int = MAX_BODY_BYTES, default_chat_tokens: int = 512):
        self.engine, self.api_key, self.max_body_bytes = engine, api_key, max_body_bytes
        self.name = name or Path(engine.source).stem or "pjinfer"
        self.default_chat_tokens = default_chat_tokens
        self.scheduler = Scheduler(engine, max_active=max_active, max_queue=max_queue)
        self.created = int(time.time())
        self._box: _Outbox | None = None
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI(title="pjinfer", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ApiError)
        async def api_error(request, exc: ApiError):
            return exc.response()

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request, exc):
            return ApiError(exc.status_code, str(exc.detail), type="not_found_error" if exc.status_code == 404
                            else "invalid_request_error").response()

        @app.exception_handler(Exception)
        async def unexpected(request, exc):
            log.exception("unexpected error")
            return ApiError(500, f"internal error: {type(exc).__name__}", type="server_error").response()

        app.add_middleware(_Guard, server=self)

        @app.get("/health")
        async def health():
            return {"status": "ok", "active": self.scheduler.active, "waiting": self.scheduler.waiting}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                                "owned_by": "pjinfer"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await self._parse(request, CompletionRequest)
            prompt = body.prompt
            if isinstance(prompt, list):
                if len(prompt) != 1:
                    raise ApiError(400, "one prompt per request", param="prompt")
                prompt = prompt[0]
            if not prompt:
                raise ApiError(400, "the prompt is empty", param="prompt")
            ids = self.engine.tokenizer.encode(prompt)
            return await self._run(request, body, ids, body.max_tokens or 16, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await self._parse(request, ChatRequest)
            tok = self.engine.tokenizer
            try:
                text = tok.apply_chat(message_text(body.messages))
            except ConfigError as e:
                raise ApiError(400, str(e), param="messages") from None
            ids = tok.encode(text, add_special=False)
            room = self.engine.config.max_seq_len - len(ids)
            max_tokens = body.max_completion_tokens or body.max_tokens or max(1, min(self.default_chat_tokens, room))
            return await self._run(request, body, ids, max_tokens, chat=True)

        return app

    # ------------------------------------------------------------ pieces of a request
    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise ApiError(401, "missing or invalid API key (send: Authorization: Bearer KEY)",
                           type="authentication_error", code="invalid_api_key")

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused (413) once it passes the limit: a chunked body is never held past it (the rest, up to
        twice the limit, is read and dropped first, as `_drain` says why)."""
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size <= self.max_body_bytes:
                    chunks.append(chunk)
                elif size > 2 * self.max_body_bytes:
                    break
        except ClientDisconnect:
            raise ApiError(400, "the client went away while sending the body") from None
        if size > self.max_body_bytes:
            raise ApiError(413, f"request body over {self.max_body_bytes} bytes")
        return b"".join(chunks)

    async def _parse(self, request: Request, model: type[BaseModel]):
        raw = await self._read_body(request)
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON ({e})") from None
        check_fields(data, model.model_fields)
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ApiError(422, f"{where or 'body'}: {first['msg']}", param=where or None) from None
        if body.model not in (None, "", self.name):
            raise ApiError(404, f"model {body.model!r} not found (this server has {self.name!r})",
                           type="not_found_error", param="model", code="model_not_found")
        return body

    def _sampling(self, body: CompletionRequest | ChatRequest) -> Sampling:
        """The request's sampling: its fields over DEFAULT_SAMPLING; its seed, or a random one (none, or -1, as
        llama-server) when it samples (runtime.sampling.choose_seed, as the CLI's)."""
        given = {name: getattr(body, name) for name in DEFAULT_SAMPLING if getattr(body, name) is not None}
        settings = {**DEFAULT_SAMPLING, **given}
        try:
            seed = choose_seed(body.seed, settings["temperature"])
            return Sampling(**settings, seed=0 if seed is None else seed)
        except ConfigError as e:
            raise ApiError(400, str(e), param="seed" if "seed" in str(e) else None) from None

    async def _run(self, request: Request, body: CompletionRequest | ChatRequest, ids: list[int], max_tokens: int,
                   *, chat: bool):
        sampling = self._sampling(body)
        try:
            self.engine.plan(len(ids), max_tokens)
        except ConfigError as e:
            raise ApiError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if any(not stop for stop in stops):
            raise ApiError(400, "a stop string must not be empty", param="stop")
        events = asyncio.Queue()
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        job = Job(ids, max_tokens, sampling, self._outbox().sender(events), stops=stops,
                  stop_ids=() if body.ignore_eos else None, name=rid)
        try:
            self.scheduler.submit(job)
        except SchedulerClosed as e:
            raise ApiError(503, str(e), type="server_error") from None
        except QueueFull as e:
            raise ApiError(429, str(e), type="server_error", code="server_busy",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        reply = _Reply(rid, self.name, chat, len(ids))
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._stream(job, events, reply, include_usage),
                                     media_type="text/event-stream")
        watcher = asyncio.create_task(self._cancel_on_disconnect(request, job))
        try:
            pieces = []
            while True:
                kind, value = await events.get()
                if kind == "text":
                    pieces.append(value)
                elif kind == "error":
                    raise ApiError(503 if "shutting down" in value else 500, value, type="server_error")
                else:
                    self._log(rid, job)
                    return reply.whole("".join(pieces), value, job.completion_tokens)
        finally:
            watcher.cancel()
            self.scheduler.cancel(job)   # a no-op once done; frees the place if the handler is cancelled

    async def _cancel_on_disconnect(self, request: Request, job: Job) -> None:
        """Cancels `job` when its client disconnects (the body has been read: the next ASGI message that matters is
        http.disconnect). Runs beside the handler that waits for the job's events, which then get its "done"."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.scheduler.cancel(job)
                return

    async def _stream(self, job: Job, events: asyncio.Queue, reply: "_Reply", include_usage: bool):
        """The SSE body. Starlette's StreamingResponse watches for the client's disconnect and then cancels this
        generator, whose `finally` cancels the job."""
        try:
            if reply.chat:
                yield _sse(reply.chunk(role=True))
            held = None
            while True:
                kind, value = held or await events.get()
                held = None
                if kind == "text":
                    # The pieces already here go out as one chunk: a batched call delivers several tokens at once.
                    while not events.empty():
                        event = events.get_nowait()
                        if event[0] != "text":
                            held = event
                            break
                        value += event[1]
                    yield _sse(reply.chunk(text=value))
                elif kind == "error":
                    yield _sse({"error": {"message": value, "type": "server_error", "param": None, "code": None}})
                    break
                else:
                    yield _sse(reply.chunk(finish=value))
                    if include_usage:
                        yield _sse(reply.usage_chunk(job.completion_tokens))
                    self._log(reply.id, job)
                    break
            yield "data: [DONE]\n\n"
        finally:
            self.scheduler.cancel(job)   # the client went away: the scheduler drops the job at its next step

    def _outbox(self) -> "_Outbox":
        """The running event loop's outbox (one per loop: tests may serve the same Server from several loops)."""
        loop = asyncio.get_running_loop()
        if self._box is None or self._box.loop is not loop:
            self._box = _Outbox(loop)
        return self._box

    def _log(self, rid: str, job: Job) -> None:
        if job.finish_reason == "cancelled":
            return                       # the scheduler wrote its "client went away" line
        ttft = (job.first_token or job.finished) - job.submitted
        decode = job.finished - job.first_token if job.first_token else 0.0
        rate = (job.completion_tokens - 1) / decode if job.completion_tokens > 1 and decode > 0 else 0.0
        log.info("%s prompt %d tokens, completion %d tokens, first token %.3f s, %.1f tok/s, finish %s", rid,
                 len(job.prompt_ids), job.completion_tokens, ttft, rate, job.finish_reason)


class _Outbox:
    """Carries the scheduler thread's events to the requests' queues on the event loop. A batched call emits up
    to a few events per request; the loop is woken once for all the events that arrive before it runs (one
    call_soon_threadsafe, not one per event), and each queue receives its events in the order they were sent."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self._pending, self._lock = loop, [], threading.Lock()

    def sender(self, events: asyncio.Queue):
        """A Job.emit for the request whose events go to `events`: thread-safe, never blocks."""
        return lambda event: self._put(events, event)

    def _put(self, events: asyncio.Queue, event: tuple) -> None:
        with self._lock:
            self._pending.append((events, event))
            wake = len(self._pending) == 1
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:      # the loop is closed: nobody is left to read these events
                with self._lock:
                    self._pending.clear()

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for events, event in pending:
            events.put_nowait(event)


class _Reply:
    """OpenAI's response objects for one request."""

    def __init__(self, rid: str, model: str, chat: bool, prompt_tokens: int):
        self.id, self.model, self.chat, self.prompt_tokens = rid, model, chat, prompt_tokens
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def whole(self, text: str, finish: str, completion_tokens: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                      "logprobs": None}
            return {**self._head("chat.completion"), "choices": [choice], "usage": self.usage(completion_tokens)}
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return {**self._head("text_completion"), "choices": [choice], "usage": self.usage(completion_tokens)}

    def chunk(self, *, text: str = "", finish: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            return {**self._head("chat.completion.chunk"),
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        return {**self._head("text_completion"),
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}

    def usage_chunk(self, completion_tokens: int) -> dict:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": self.usage(completion_tokens)}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Uvicorn(uvicorn.Server):
    """On SIGINT/SIGTERM the scheduler stops first: open streams end cleanly, waiting requests get 503. The signal
    is the normal way to stop, so it is not raised again after shutdown (uvicorn's default): the process exits 0.
    A second SIGINT forces the exit."""

    def __init__(self, config, scheduler: Scheduler):
        super().__init__(config)
        self.scheduler = scheduler

    def handle_exit(self, sig, frame):
        self.scheduler.close()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening), for `serve`. Binding before the model loads makes a
    busy port or a bad host one ConfigError ("port 8080 is in use") rather than uvicorn's error after startup."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn: a recent TIME_WAIT does not block
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} is in use") from None
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def serve(server: Server, sock: socket.socket) -> None:
    """Serves on `sock` (from `bind`) until SIGINT/SIGTERM, then returns once open requests have ended (a step being
    compiled may delay that; after 60 s open connections are cut)."""
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(server.app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=60)
    _Uvicorn(config, server.scheduler).run(sockets=[sock])
    server.scheduler.close()
    server.scheduler.join(timeout=10)
