"""The gateway: an OpenAI-compatible HTTP endpoint in front of the bus's inference.

    rlbus role gateway --run R          # started by `rlbus up` when [gateway] enabled,
    rlbus serve --model DIR             # and by `rlbus serve` (a server, inference, it)

``POST /v1/chat/completions`` renders the messages with the run's renderer (the model's
chat template, ``roles.lib.model.render``: the same tokens a rollout would see), sends
``n`` generate requests on ``rl.<run>.infer.<model>`` (the inference role's queue group,
as env servers do), reads each completion back (content, reasoning, tool calls) and
answers in OpenAI's format plus the exact tokens (``roles.lib.openai_api``).
``POST /v1/completions`` takes text (encoded with the tokenizer's own special tokens) or
token ids; ``POST /inference/v1/generate`` is vLLM's token-in/token-out endpoint (what
verifiers' and prime-rl's training clients call with prompts they rendered); ``GET /v1/models`` lists the model keys it serves (``policy`` and
``orchestrator.models``'s keys).

A request with an ``X-Session-ID`` header goes to one replica of the model, the same
for every request of that session while it lives (``session_replica``), so a multi-turn
conversation reuses the prompt prefix that replica has cached; without it, or when that
replica is gone, any replica answers (the queue group).

Authenticated: every request needs ``Authorization: Bearer <key>``, the run's API key
(``run_api_key``: ``<run>/auth/api.key``, written once, mode 0600), else 401. It binds
``gateway.host`` (loopback by default) and ``gateway.port`` (0: a free one; the
heartbeat's info says which: ``base_url``). A bad request is a 4xx with OpenAI's error
body; an inference failure is a 4xx (``context_length_exceeded``) or 5xx (a timeout: 504)
with one; nothing a client sends stops the gateway.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bus.errors import NoResponders, RequestTimeout
from configs.paths import RunPaths
from roles.lib.clients import InferenceClient
from roles.lib.model.render import Reply, completion_text
from roles.lib.openai_api import (
    ApiError,
    ChatRequest,
    Choice,
    CompletionRequest,
    TokensRequest,
    chat_messages,
    chat_response,
    completion_response,
    failure_error,
    models_response,
    parse_request,
    tokens_response,
)
from roles.runtime.context import RoleContext
from roles.runtime.role import Role, serve_role
from schemas import GenerateResult, InferenceFailed, SamplingParams
from schemas.arrays import f32, i32

API_KEY_FILE = "api.key"
SESSION_HEADER = "X-Session-ID"


def session_replica(session: str | None, instances: Sequence[str]) -> str | None:
    """The replica a session's requests go to (None: no session, or no live replica):
    rendezvous hashing, so a session moves only when its replica goes away, and the
    others keep theirs when replicas come and go."""
    if not session or not instances:
        return None

    def weight(instance: str) -> bytes:
        return hashlib.blake2b(f"{session}\0{instance}".encode(), digest_size=8).digest()

    return max(instances, key=weight)


def run_api_key(paths: RunPaths) -> str:
    """The run's API key (``<run>/auth/api.key``), created on first use (0600; a racing
    creator's key wins, and both read it)."""
    path = paths.auth / API_KEY_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(f"rlbus-{secrets.token_urlsafe(24)}\n")
    return Path(path).read_text().strip()


class Gateway(Role):
    role = "gateway"

    def __init__(self, bus: Any, ctx: RoleContext) -> None:
        super().__init__(bus, ctx.instance, ctx.cfg.bus.heartbeat_interval_s)
        self.ctx, self.cfg = ctx, ctx.cfg.gateway
        self.models = list(ctx.cfg.orchestrator.model_keys())
        self.created = int(time.time())
        self.base_url = ""
        self.answered = 0
        self._live: set[str] = set()
        self._replicas: dict[str, list[str]] = {}  # model -> live inference instances
        self._live_at = -1e9

    async def setup(self) -> None:
        from aiohttp import web

        from roles.lib.model.loading import load_tokenizer
        from roles.lib.model.render import make_renderer

        cfg = self.ctx.cfg
        self.key = run_api_key(self.ctx.paths)
        self.tokenizer = await asyncio.to_thread(
            load_tokenizer, self.ctx.model_dir(), local_files_only=cfg.model.local_files_only
        )
        self.renderer = make_renderer(self.tokenizer, cfg.model.renderer)
        self.client = InferenceClient.from_config(self.bus, cfg.inference)
        app = web.Application(middlewares=[self._middleware()],
                              client_max_size=self.cfg.max_body_bytes)  # fmt: skip
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/inference/v1/generate", self.generate_tokens)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.cfg.host, self.cfg.port)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}/v1"
        self.log.info("gateway.serving", base_url=self.base_url, models=self.models)

    async def teardown(self) -> None:
        await self.runner.cleanup()

    async def status(self) -> dict[str, object]:
        return {"info": {"base_url": self.base_url, "answered": str(self.answered)}}

    # -- HTTP -------------------------------------------------------------------------

    def _middleware(self) -> Any:
        """Every request: the API key checked, then the handler; whatever goes wrong is
        answered with OpenAI's error body (a bug in here: a 500, logged)."""
        from aiohttp import web

        def answer(e: ApiError) -> Any:
            return web.json_response(e.body(), status=e.status)

        @web.middleware
        async def middleware(request: Any, handler: Any) -> Any:
            try:
                given = request.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {self.key}".encode()):
                    what = "no API key" if not given else "a wrong API key"
                    raise ApiError(401, f"{what}: send Authorization: Bearer <the run's api key>",
                                   code="invalid_api_key")  # fmt: skip
                return await handler(request)
            except ApiError as e:
                return answer(e)
            except web.HTTPException as e:  # 404 route, 405 method, 413 body too large
                return answer(ApiError(e.status, e.reason or "bad request"))
            except Exception as e:  # noqa: BLE001 - one bad request never stops the gateway
                self.log.exception("gateway.error", path=request.path)
                return answer(ApiError(500, f"{type(e).__name__}: {e}"))

        return middleware

    async def list_models(self, request: Any) -> Any:
        from aiohttp import web

        live = await self._live_models()
        return web.json_response(
            models_response([m for m in self.models if m in live], self.created)
        )

    async def chat(self, request: Any) -> Any:
        from aiohttp import web

        req: ChatRequest = parse_request(ChatRequest, await request.read())
        model = await self._model(req.model)
        messages = chat_messages(req.messages)
        try:
            prompt = self.renderer.render_prompt(messages, req.tools)
        except Exception as e:  # noqa: BLE001 - the template's own complaint, as a 400
            raise ApiError(400, f"messages: the chat template cannot render them: {e}",
                           param="messages") from None  # fmt: skip
        rid = uuid.uuid4().hex
        replica = session_replica(
            request.headers.get(SESSION_HEADER), self._replicas.get(model, [])
        )
        results = await self._generate(model, rid, prompt, self._sampling(req), req.n, req.seed,
                                       self.renderer.stop_token_ids, replica)  # fmt: skip
        tools = bool(req.tools)
        choices = [self._choice(r, self.renderer.parse_reply(i32(r.completion_ids).tolist(), prompt, tools))
                   for r in results]  # fmt: skip
        body = chat_response(rid, req.model, prompt, choices, self.tokenizer, req.logprobs)
        return web.json_response(body)

    async def complete(self, request: Any) -> Any:
        from aiohttp import web

        req: CompletionRequest = parse_request(CompletionRequest, await request.read())
        model = await self._model(req.model)
        if isinstance(req.prompt, str):
            prompt = list(self.tokenizer.encode(req.prompt))
        else:
            prompt = self._token_ids(req.prompt, "prompt")
        rid = uuid.uuid4().hex
        replica = session_replica(
            request.headers.get(SESSION_HEADER), self._replicas.get(model, [])
        )
        results = await self._generate(model, rid, prompt, self._sampling(req), req.n, req.seed,
                                       self.renderer.stop_token_ids, replica)  # fmt: skip
        choices = [
            self._choice(r, self._text_reply(i32(r.completion_ids).tolist())) for r in results
        ]
        body = completion_response(rid, req.model, prompt, choices, self.tokenizer,
                                   req.logprobs is not None)  # fmt: skip
        return web.json_response(body)

    async def generate_tokens(self, request: Any) -> Any:
        """vLLM's token-in/token-out ``/inference/v1/generate`` (what verifiers' and
        prime-rl's training clients call): the caller rendered the prompt."""
        from aiohttp import web

        req: TokensRequest = parse_request(TokensRequest, await request.read())
        model = await self._model(req.model)
        prompt = self._token_ids(req.token_ids, "token_ids")
        sp = req.sampling_params
        sampling = SamplingParams(temperature=sp.temperature, top_p=sp.top_p,
                                  top_k=max(sp.top_k, 0),
                                  max_completion_tokens=sp.max_tokens or self.cfg.max_tokens)  # fmt: skip
        rid = uuid.uuid4().hex
        replica = session_replica(
            request.headers.get(SESSION_HEADER), self._replicas.get(model, [])
        )
        stops = self._token_ids(sp.stop_token_ids, "sampling_params.stop_token_ids")
        [r] = await self._generate(model, rid, prompt, sampling, 1, sp.seed,
                                   stops or self.renderer.stop_token_ids, replica)  # fmt: skip
        return web.json_response(tokens_response(rid, prompt, r))

    def _token_ids(self, ids: list[int], param: str) -> list[int]:
        if any(not 0 <= t < len(self.tokenizer) for t in ids):
            raise ApiError(400, f"{param}: token ids must be in [0, {len(self.tokenizer)})",
                           param=param)  # fmt: skip
        return list(ids)

    # -- the bus ----------------------------------------------------------------------

    async def _model(self, name: str) -> str:
        """``name`` if the run has that model and a live replica serves it, else a 404
        (not the run's) or a 503 (nothing serves it now)."""
        if name not in self.models:
            raise ApiError(404, f"model {name!r} does not exist (the run's: {', '.join(self.models)})",
                           param="model", code="model_not_found")  # fmt: skip
        if name not in await self._live_models():
            raise ApiError(503, f"no inference replica serves {name!r} now", param="model")
        return name

    async def _live_models(self) -> set[str]:
        """The run's models with a live server in the role registry (asked at most every
        heartbeat interval)."""
        from bus.registry import is_alive

        now = time.monotonic()
        if now - self._live_at > self.heartbeat_interval_s:
            beats = await self.bus.live_roles()
            alive = [hb.instance for hb in beats
                     if hb.role in ("inference", "teacher") and is_alive(hb, self.heartbeat_interval_s)]  # fmt: skip
            self._live = {m for m in self.models
                          if any(i.startswith((f"inference-{m}-", f"teacher-{m}-")) for i in alive)}  # fmt: skip
            self._replicas = {m: sorted(i for i in alive if i.startswith(f"inference-{m}-"))
                              for m in self.models}  # fmt: skip
            self._live_at = now
        return self._live

    def _sampling(self, req: ChatRequest | CompletionRequest) -> SamplingParams:
        return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              max_completion_tokens=req.budget(self.cfg.max_tokens),
                              stop=req.stops())  # fmt: skip

    async def _generate(
        self, model: str, rid: str, prompt: list[int], sampling: SamplingParams, n: int,
        seed: int | None, stop_ids: list[int], replica: str | None = None,
    ) -> list[GenerateResult]:  # fmt: skip
        """``n`` completions of ``prompt`` (seeds ``seed + k``, else random), stopping at
        ``stop_ids``, on ``replica`` when the session has one."""
        base = seed if seed is not None else secrets.randbits(62)
        jobs = [
            self.client.generate(model, f"gw-{rid}-{k}", prompt, sampling, stop_ids, seed=base + k)
            for k in range(n)
        ]
        try:
            replies = await asyncio.gather(*jobs)
        except NoResponders as e:
            raise ApiError(503, f"no inference replica serves {model!r}: {e}") from None
        except RequestTimeout as e:
            raise ApiError(504, f"inference did not answer in time: {e}") from None
        for r in replies:
            if isinstance(r, InferenceFailed):
                raise failure_error(r)
        self.answered += len(replies)
        return [r for r in replies if isinstance(r, GenerateResult)]

    def _choice(self, r: GenerateResult, reply: Reply) -> Choice:
        return Choice(i32(r.completion_ids).tolist(), f32(r.logprobs).tolist(), r.finish_reason,
                      reply, r.policy_version)  # fmt: skip

    def _text_reply(self, ids: list[int]) -> Reply:
        text = completion_text(self.tokenizer, self.renderer.stop_token_ids, ids)
        return Reply(text, text, None, [], None)


async def main(ctx: RoleContext) -> None:
    bus = await ctx.connect()
    await serve_role(Gateway(bus, ctx))


__all__ = ["API_KEY_FILE", "SESSION_HEADER", "Gateway", "main", "run_api_key", "session_replica"]
