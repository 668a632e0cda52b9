"""`minispec serve`: an OpenAI-compatible HTTP server over ONE speculative engine.

    POST /v1/completions, POST /v1/chat/completions   (stream with server-sent events, or not)
    GET  /v1/models, /health, /metrics (Prometheus, vLLM's names), /stats.json, / (a live page)

Safe by default: it binds 127.0.0.1; with --api-key every /v1 route wants `Authorization: Bearer
KEY` (compared in constant time; the key is never logged); bodies over --max-body-bytes get 413,
prompts longer than the context 400, a body not in within BODY_TIMEOUT_S 408, and past
--max-concurrency sequences in flight (each request counts its prompts x n) 429.
A client that disconnects aborts its requests (their pages are freed); on SIGINT / SIGTERM streams get a final error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import sys
import threading
import time
from pathlib import Path

import jinja2
from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from ..llm import LLM
from ..runtime.kv_cache import KVPoolExhausted
from .engine_loop import EngineLoop
from .limits import BODY_TIMEOUT_S, Slots, once
from .metrics import ServerMetrics, drafter_name
from .protocol import (ApiError, Parsed, accumulate, logprobs_json, openai_reason, parse_chat, parse_completion,
                       response_id, usage)

DASHBOARD = Path(__file__).with_name("dashboard.html")


class Server:
    def __init__(self, llm: LLM, model_name: str, api_key: str | None, max_body_bytes: int, max_concurrency: int):
        self.llm, self.model_name, self.api_key = llm, model_name, api_key
        self.max_body_bytes, self.max_concurrency = max_body_bytes, max_concurrency
        self.slots = Slots(max_concurrency)
        self.created = int(time.time())  # what /v1/models says
        self.body_timeout_s = BODY_TIMEOUT_S
        self.metrics = ServerMetrics(model_name, drafter_name(llm.engine.drafter), llm.engine.k)
        self.loop = EngineLoop(llm, self.metrics)
        self.context = llm.engine.max_model_len

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> dict:
        if not self.llm.tokenizer.chat_template:
            raise ApiError("this model has no chat template: use /v1/completions", "messages")
        try:
            return self.llm.tokenizer.chat_prompt(messages, add_generation_prompt)
        except (ValueError, jinja2.TemplateError) as e:  # the template refuses the conversation
            raise ApiError(" ".join(str(e).split()), "messages") from None

    async def body(self, request: Request) -> dict:
        """The JSON body, read up to max_body_bytes (413 past it)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ApiError(f"request body over {self.max_body_bytes} bytes", None, 413)
        data = b""
        async for chunk in request.stream():
            data += chunk
            if len(data) > self.max_body_bytes:
                raise ApiError(f"request body over {self.max_body_bytes} bytes", None, 413)
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(f"the body is not valid JSON ({e})") from None
        except RecursionError:
            raise ApiError("the body's JSON is nested too deeply") from None
        if not isinstance(body, dict):
            raise ApiError("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(f"model '{model}' does not exist; this server serves '{self.model_name}'", "model", 404,
                           "not_found_error")
        return body

    def authorized(self, request: Request) -> bool:
        if self.api_key is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())

    async def complete(self, request: Request, chat: bool):
        """The body is read (within body_timeout_s: a client that trickles it holds no slot) and
        parsed; then its sequences take their slots (429 when too few are left) and give them back
        exactly once: when the request is refused here, or when its call ends (finished,
        cancelled or stopped)."""
        try:
            body = await asyncio.wait_for(self.body(request), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(f"the request body did not arrive within {self.body_timeout_s:g} s", None, 408) from None
        try:
            parsed = parse_chat(body, self.context, self.render_chat) if chat else parse_completion(body, self.context)
        except (ValueError, TypeError) as e:
            raise ApiError(" ".join(str(e).split()), "messages" if chat else "prompt") from None
        k = len(parsed.prompts) * parsed.params.n
        if k > self.max_concurrency:
            raise ApiError(f"this request asks for {k} sequences (prompts x n); the server runs at most "
                           f"{self.max_concurrency} at once", "n")
        if not self.slots.take(k):
            raise ApiError(f"more than {self.max_concurrency} sequences in flight; retry later", None, 429,
                           "rate_limit_error")
        release = once(lambda: self.slots.give(k))
        try:
            handle = await asyncio.to_thread(self.loop.submit, parsed.prompts, parsed.params,
                                             asyncio.get_running_loop(), release)
        except (ValueError, TypeError) as e:  # a prompt over the context, token ids outside the vocabulary, ...
            release()
            raise ApiError(" ".join(str(e).split()), "messages" if chat else "prompt") from None
        except KVPoolExhausted as e:  # the request could never fit the KV pool, even alone
            release()
            raise ApiError(" ".join(str(e).split()), "max_tokens") from None
        except BaseException:
            release()
            raise
        ident = response_id(chat)
        if parsed.stream:
            return StreamingResponse(self.stream(request, handle, parsed, ident), media_type="text/event-stream")
        return JSONResponse(await self.collect(request, handle, parsed, ident))

    async def collect(self, request: Request, handle, parsed: Parsed, ident) -> dict:
        """Wait for every event of the call (the client's disconnect cancels it); one response."""
        disconnect = asyncio.ensure_future(wait_for_disconnect(request))
        choices: dict[tuple, dict] = {}
        try:
            while True:
                getter = asyncio.ensure_future(handle.queue.get())
                done, _ = await asyncio.wait({getter, disconnect}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    raise asyncio.CancelledError
                event = getter.result()
                if event is None:
                    break
                if isinstance(event, dict):
                    raise ApiError(event["error"], None, 503, "server_error")
                accumulate(choices, event)
        except BaseException:
            self.loop.cancel(handle)
            raise
        finally:
            disconnect.cancel()
        return self.response(handle, parsed, ident, choices)

    def response(self, handle, parsed: Parsed, ident, choices: dict) -> dict:
        n = parsed.params.n
        out, drafted, accepted = [], 0, 0
        for (i, j), c in sorted(choices.items()):
            drafted, accepted = drafted + c["drafted"], accepted + c["accepted"]
            choice = {"index": i * n + j, "finish_reason": openai_reason(c["finish_reason"]), "stop_reason": c["stop_reason"]}
            if parsed.chat:
                choice["message"] = {"role": "assistant", "content": c["text"]}
            else:
                choice["text"] = c["text"]
            choice["logprobs"] = (logprobs_json(c["logprobs"], c["tokens"], parsed.chat, parsed.logprobs or 0)
                                  if parsed.logprobs is not None else None)
            out.append(choice)
        return {"id": ident[0], "object": "chat.completion" if parsed.chat else "text_completion", "created": ident[1],
                "model": self.model_name, "choices": out,
                "usage": usage(handle.call, n, sum(len(c["tokens"]) for c in choices.values())),
                "speculative": {"draft_tokens": drafted, "accepted_tokens": accepted}}

    async def stream(self, request: Request, handle, parsed: Parsed, ident):
        """Server-sent events: one chunk per step's new text per choice, a last chunk with the
        finish reason, usage if asked, then [DONE]. Cancelled (client gone): the call is closed."""
        obj = "chat.completion.chunk" if parsed.chat else "text_completion"
        n = parsed.params.n

        def chunk(index: int, delta: dict | str, finish=None, logprobs=None) -> str:
            choice = {"index": index, "finish_reason": finish, "logprobs": logprobs}
            choice.update({"delta": delta} if parsed.chat else {"text": delta})
            body = {"id": ident[0], "object": obj, "created": ident[1], "model": self.model_name, "choices": [choice]}
            if parsed.include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        tokens, offsets, speculative = {}, {}, {"draft_tokens": 0, "accepted_tokens": 0}  # offsets: text_offset so far
        try:
            if parsed.chat:
                for k in range(len(parsed.prompts) * n):
                    yield chunk(k, {"role": "assistant", "content": ""})
            while True:
                event = await handle.queue.get()
                if event is None:
                    break
                if isinstance(event, dict) or event.error:  # the server stopping, or the request failed
                    failed = ApiError(event["error"], None, 503, "server_error") if isinstance(event, dict) else \
                        ApiError(f"the request failed: {event.error}", None, 500, "server_error")  # (as a response would say)
                    yield f"data: {json.dumps(failed.body())}\n\n"
                    break
                index = event.index * n + event.completion_index
                tokens[index] = tokens.get(index, 0) + len(event.new_token_ids)
                speculative["draft_tokens"] += event.num_drafted
                speculative["accepted_tokens"] += event.num_accepted
                logprobs = (logprobs_json(event.new_logprobs, event.new_token_ids, parsed.chat, parsed.logprobs or 0,
                                          offsets.get(index, 0))
                            if parsed.logprobs is not None and event.new_logprobs else None)
                if logprobs is not None and not parsed.chat:
                    offsets[index] = offsets.get(index, 0) + sum(map(len, logprobs["tokens"]))
                if event.new_text or logprobs:
                    yield chunk(index, {"content": event.new_text} if parsed.chat else event.new_text, logprobs=logprobs)
                if event.finished:
                    yield chunk(index, {} if parsed.chat else "", openai_reason(event.finish_reason))
            if parsed.include_usage:
                last = {"id": ident[0], "object": obj, "created": ident[1], "model": self.model_name, "choices": [],
                        "usage": usage(handle.call, n, sum(tokens.values())), "speculative": speculative}
                yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # finished, or cancelled because the client went away: its requests leave the engine
            self.loop.cancel(handle)


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()  # the engine thread lives as long as the app
        try:
            yield
        finally:
            server.loop.stop()

    app = FastAPI(title="minispec", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    async def api_key(request: Request) -> None:  # (a dependency, not an HTTP middleware: those log a traceback
        if not server.authorized(request):           # for every client that disconnects before its response)
            raise ApiError("missing or wrong API key", None, 401, "authentication_error")

    @app.post("/v1/completions", dependencies=[Depends(api_key)])
    async def completions(request: Request):
        return await server.complete(request, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(api_key)])
    async def chat(request: Request):
        return await server.complete(request, chat=True)

    @app.get("/v1/models", dependencies=[Depends(api_key)])
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "minispec", "max_model_len": server.context}]}

    @app.get("/health")
    async def health():
        return Response(status_code=200 if server.loop.thread.is_alive() else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.prometheus(), media_type="text/plain; version=0.0.4")

    @app.get("/stats.json")
    async def stats():
        return server.metrics.stats()

    @app.get("/")
    async def dashboard():
        return HTMLResponse(DASHBOARD.read_text())

    return app


def serve(llm: LLM, host: str, port: int, model_name: str, api_key: str | None, max_body_bytes: int,
          max_concurrency: int) -> None:
    import uvicorn

    server = Server(llm, model_name, api_key, max_body_bytes, max_concurrency)

    class Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            """SIGINT / SIGTERM: the engine stops at once and every stream in flight gets a final
            error event, then uvicorn closes the connections."""
            threading.Thread(target=server.loop.stop, daemon=True).start()
            super().handle_exit(sig, frame)

    print(f"[minispec] serving {model_name} on http://{host}:{port} (live page at /, metrics at /metrics)"
          + (", API key required" if api_key else ""), file=sys.stderr)
    config = uvicorn.Config(build_app(server), host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    try:
        Uvicorn(config).run()
    except KeyboardInterrupt:  # uvicorn raises the signal again once it has stopped: a clean exit
        pass
