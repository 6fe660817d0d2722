"""The FastAPI application: OpenAI-compatible endpoints over one `Engine`.

    POST /v1/chat/completions   chat (messages through the model's chat template), JSON or SSE stream
    POST /v1/completions        raw text continuation (no template), JSON or SSE stream
    GET  /v1/models             the one model served
    GET  /health                liveness, never needs the API key
    GET  /metrics               Prometheus text format

Every request is validated and tokenized here, on the event loop, before it is queued: a bad parameter, an
unknown model or a prompt that does not fit the context is answered with a 4xx and costs no generation.
Generation itself happens on the worker thread (see worker.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import EagleSpecError
from ..spec.batch import PREFILL_CHUNK
from ..spec.decode import Step
from ..spec.prefix import DEFAULT_BYTES as PREFIX_CACHE_BYTES
from ..spec.verify import SamplingParams
from .batch_worker import BatchWorker
from .metrics import ServerMetrics
from .schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    parse_request,
)
from .thread import GenerationThread
from .worker import Cancelled, Done, GenerationParams, GenerationWorker, Job

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"


@dataclass
class ServerConfig:
    model_name: str = "smollm2-135m"  # the `model` clients must send
    api_key: str | None = None  # None: no authentication
    max_queue: int = 64  # requests allowed to wait; more get 503
    timeout: float = 600.0  # seconds from arrival to the last token, queue wait included
    max_tokens_limit: int = 2048  # largest max_tokens accepted (and the chat default cap)
    completion_default_max_tokens: int = 16  # OpenAI's default for /v1/completions
    max_body_bytes: int = 4 << 20
    max_batch: int = 1  # requests decoded together (batch_worker.py); 1: one at a time (worker.py)
    speculate: str = "auto"  # with max_batch > 1: "auto" (load-aware), "always" or "never"
    prefill_chunk: int = PREFILL_CHUNK  # with max_batch > 1: prompt rows a step reads while others decode
    prefix_cache_bytes: int = PREFIX_CACHE_BYTES  # with max_batch > 1: the prefix cache's budget (0: none)


class Server:
    """Request handling shared by the endpoints; owns the worker and the metrics."""

    def __init__(self, engine, config: ServerConfig, thread: GenerationThread | None = None):
        """`thread`: the thread that built `engine`, which then also runs the worker (serve/thread.py)."""
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics(config.model_name)
        thread = thread or GenerationThread()
        if config.max_batch > 1:  # (its KV-cache slots are allocated on the generation thread too)
            self.worker = thread.call(BatchWorker, engine, self.metrics, max_queue=config.max_queue,
                                      timeout=config.timeout, max_batch=config.max_batch,
                                      speculate=config.speculate, prefill_chunk=config.prefill_chunk,
                                      prefix_cache_bytes=config.prefix_cache_bytes, thread=thread)
        else:
            self.worker = GenerationWorker(engine, self.metrics, max_queue=config.max_queue, timeout=config.timeout,
                                           thread=thread)
        self.created = int(time.time())

    # ---- authentication ------------------------------------------------------------------------------------
    def check_api_key(self, request: Request) -> None:
        key = self.config.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "Missing API key: send it as 'Authorization: Bearer <key>'.", code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    # ---- request -> job ------------------------------------------------------------------------------------
    async def read_body(self, request: Request) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.config.max_body_bytes:
                raise APIError(413, f"The request body is larger than {self.config.max_body_bytes} bytes.",
                               code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def prepare(self, req: ChatCompletionRequest | CompletionRequest) -> GenerationParams:
        """Check everything that can be checked before generating; the prompt's token ids and settings."""
        if req.model != self.config.model_name:
            raise APIError(404, f"The model '{req.model}' does not exist. This server serves "
                                f"'{self.config.model_name}'.", param="model", code="model_not_found")
        sampling = dict(temperature=req.temperature if req.temperature is not None else 0.0,
                        top_p=req.top_p if req.top_p is not None else 1.0,
                        top_k=req.top_k if req.top_k is not None else 0, seed=req.seed)
        try:
            SamplingParams(**sampling)
        except EagleSpecError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
        prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        ids = self.encode(req)
        limit = self.config.max_tokens_limit
        max_tokens = req.requested_max_tokens()
        if max_tokens is not None and max_tokens > limit:
            name = "max_tokens" if req.max_tokens is not None else "max_completion_tokens"
            raise APIError(400, f"Invalid value for '{name}': {max_tokens} is more than this server's limit of "
                                f"{limit} tokens.", param=name, code="invalid_value")
        if max_tokens is None:
            room = self.engine.target.max_context - len(ids)
            if isinstance(req, CompletionRequest):
                max_tokens = min(self.config.completion_default_max_tokens, limit, max(room, 1))
            else:
                max_tokens = min(limit, max(room, 1))
        try:
            self.engine.decoder.check_request(len(ids), max_tokens)
        except EagleSpecError as exc:
            raise APIError(400, str(exc), param=prompt_param, code="context_length_exceeded") from None
        return GenerationParams(prompt_ids=ids, max_tokens=max_tokens, stop=list(req.stop or []), **sampling)

    def encode(self, req: ChatCompletionRequest | CompletionRequest) -> list[int]:
        try:
            if isinstance(req, ChatCompletionRequest):
                return self.engine.encode([m.as_template_message() for m in req.messages], chat=True)
            if isinstance(req.prompt, str):
                return self.engine.encode(req.prompt, chat=False)
        except EagleSpecError as exc:
            raise APIError(400, str(exc), param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                           code="invalid_value") from None
        vocab = self.engine.target.vocab_size
        bad = next((t for t in req.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"Invalid value for 'prompt': token id {bad} is outside the vocabulary "
                                f"(0..{vocab - 1}).", param="prompt", code="invalid_value")
        return list(req.prompt)

    # ---- job -> response -----------------------------------------------------------------------------------
    async def handle(self, request: Request, path: str) -> Response:
        self.metrics.request_received(path)
        model = ChatCompletionRequest if path == CHAT_PATH else CompletionRequest
        req = parse_request(model, await self.read_body(request))
        params = self.prepare(req)
        job = self.worker.submit(params, asyncio.get_running_loop())
        view = ResponseView(path, self.config.model_name, self.engine.method, req.include_usage)
        if req.stream:
            # The background task also runs when the client left before the stream even started.
            return StreamingResponse(self.sse(job, request, view), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(job.cancel))
        watch = DisconnectWatch(request)
        try:
            while True:
                event = await watch.next_event(job)
                if isinstance(event, Step):
                    continue  # the whole text comes with Done
                if isinstance(event, Done):
                    return JSONResponse(view.full(event))
                elif isinstance(event, APIError):
                    raise event
                else:  # Cancelled or the client went away: nobody will read the answer
                    return Response(status_code=499)
        finally:
            watch.close()
            job.cancel()  # a no-op when the job is done; stops it when this handler is cancelled

    async def sse(self, job: Job, request: Request, view: "ResponseView") -> AsyncIterator[str]:
        watch = DisconnectWatch(request)
        try:
            first = view.first_chunk()
            if first is not None:
                yield _sse(first)
            while True:
                event = await watch.next_event(job)
                if isinstance(event, Step):
                    if event.text:
                        yield _sse(view.text_chunk(event.text))
                elif isinstance(event, Done):
                    yield _sse(view.text_chunk("", event.result.stats.finish_reason))
                    if view.include_usage:
                        yield _sse(view.usage_chunk(event))
                    yield "data: [DONE]\n\n"
                    return
                elif isinstance(event, APIError):
                    self.metrics.request_failed(view.path, event.status)
                    yield _sse(event.body())
                    yield "data: [DONE]\n\n"
                    return
                else:
                    return
        finally:
            watch.close()
            job.cancel()  # the client disconnected (this generator was cancelled or closed) or we are done


class DisconnectWatch:
    """Notices when the client of a request goes away, by waiting on the ASGI `receive` channel for
    `http.disconnect` in a task of its own (several such listeners may wait at once), and races each wait for a
    job event against it."""

    def __init__(self, request: Request):
        self._task = asyncio.ensure_future(self._listen(request.receive))

    @staticmethod
    async def _listen(receive) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except (OSError, RuntimeError):  # the connection is unusable: treat it as gone
            return

    async def next_event(self, job: Job):
        """The job's next event, or Cancelled() (after cancelling the job) once the client has gone away."""
        get = asyncio.ensure_future(job.next_event())
        try:
            done, _ = await asyncio.wait({get, self._task}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the response itself is being cancelled (client gone, shutdown)
            get.cancel()
            raise
        if get in done:
            return get.result()
        get.cancel()
        job.cancel()
        return Cancelled()

    def close(self) -> None:
        self._task.cancel()


class ResponseView:
    """Builds the OpenAI JSON objects of one response (chat or text completion)."""

    def __init__(self, path: str, model: str, method: str, include_usage: bool):
        self.path, self.model, self.method, self.include_usage = path, model, method, include_usage
        self.chat = path == CHAT_PATH
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def usage(self, done: Done) -> dict[str, Any]:
        s = done.result.stats
        return {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.new_tokens,
            "total_tokens": s.prompt_tokens + s.new_tokens,
            "eaglespec": {
                "method": self.method,
                "tau": round(s.tau, 4),
                "target_forwards": s.target_forwards,
                "draft_tokens": done.draft_tokens,
                "accepted_tokens": sum(s.accept_lengths) - len(s.accept_lengths),
                "tokens_per_s": round(s.tokens_per_s, 2),
                "generation_time_s": round(s.total_time, 4),
            },
        }

    def full(self, done: Done) -> dict[str, Any]:
        text, reason = done.result.text, done.result.stats.finish_reason
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
            body = self._envelope("chat.completion", [choice])
        else:
            body = self._envelope("text_completion", [{"index": 0, "text": text, "logprobs": None,
                                                       "finish_reason": reason}])
        body["usage"] = self.usage(done)
        return body

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if self.include_usage:
            body["usage"] = None  # as OpenAI does: only the last chunk carries usage
        return body

    def first_chunk(self) -> dict[str, Any] | None:
        if not self.chat:
            return None
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def text_chunk(self, text: str, finish_reason: str | None = None) -> dict[str, Any]:
        if self.chat:
            delta = {"content": text} if text or finish_reason is None else {}
            return self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason})
        return self._chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason})

    def usage_chunk(self, done: Done) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = self.usage(done)
        return body


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(engine, config: ServerConfig | None = None, thread: GenerationThread | None = None) -> FastAPI:
    """The ASGI app serving `engine`. The generation worker starts and stops with the app's lifespan. `thread`:
    the thread that built `engine` (`GenerationThread.call(build)`; serve/thread.py says why)."""
    config = config or ServerConfig()
    server = Server(engine, config, thread)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.worker.stop)

    app = FastAPI(title="eaglespec", summary="OpenAI-compatible server with EAGLE speculative decoding",
                  lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    auth = [Depends(server.check_api_key)]

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if request.url.path in (CHAT_PATH, COMPLETIONS_PATH):
            server.metrics.request_failed(request.url.path, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"Unknown endpoint: {request.method} {request.url.path}.",
                   405: f"Method {request.method} is not allowed on {request.url.path}."}.get(exc.status_code,
                                                                                             str(exc.detail))
        return JSONResponse(error_body(message, code=str(exc.status_code)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        if request.url.path in (CHAT_PATH, COMPLETIONS_PATH):
            server.metrics.request_failed(request.url.path, 500)
        return JSONResponse(error_body(f"Internal server error: {type(exc).__name__}", type="server_error",
                                       code="internal_error"), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = server.worker.alive
        return JSONResponse({"status": "ok" if ok else "unavailable", "model": config.model_name,
                             "method": engine.method, "running": server.worker.running,
                             "max_batch": config.max_batch,
                             "waiting": server.worker.waiting}, status_code=200 if ok else 503)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": server.created, "owned_by": "eaglespec",
            "max_model_len": engine.target.max_context, "eaglespec": {"method": engine.method},
        }]}

    @app.get("/metrics", dependencies=auth)
    async def metrics() -> Response:
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/reset_prefix_cache", dependencies=auth)
    async def reset_prefix_cache() -> dict[str, Any]:
        """Forget the prompts read so far (benchmarks: so that a prompt sent again is read again)."""
        return {"object": "prefix_cache_reset", "reset": server.worker.reset_prefix_cache()}

    @app.post(CHAT_PATH, dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        return await server.handle(request, CHAT_PATH)

    @app.post(COMPLETIONS_PATH, dependencies=auth)
    async def completions(request: Request) -> Response:
        return await server.handle(request, COMPLETIONS_PATH)

    return app
