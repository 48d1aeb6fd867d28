"""Agent envs: env code that drives the conversation itself through an OpenAI client.

    class Solver(AgentHarness):
        async def run(self, client, model, task, state):
            messages = [{"role": "user", "content": task["question"]}]
            r = await client.chat.completions.create(model=model, messages=messages)
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            ...                                   # tools, more turns, a judge: anything
            return messages                       # what the rubric scores

Each rollout gets its own ``openai.AsyncOpenAI`` (the official client) whose transport
is this rollout's endpoint, in process (``RolloutEndpoint``: no socket, the wire format
of ``roles.lib.openai_api``). ``model`` names the policy; any other model key of the run
(a judge, a reference) may be named too. Every call is answered by the bus's inference,
as a turn of the harness would be, and recorded:

- a call to the policy is a turn of the trace. Its prompt is built token in / token out
  when its messages extend the last call's messages and the reply as returned: the last
  prompt, the completion as sampled, then the new messages in the template's framing
  (``renderer.next_turn``). So the trace's branch is exactly what was sampled, and it
  trains. A call whose messages rewrite the history (not an extension) cannot be one
  sequence with the others: the rollout is errored (``render_error``), never trained on
  tokens nobody sampled;
- a call to another model is recorded as a message of that model (``Message.model``)
  outside the trained branch: it never trains.

Agent code that cannot take an in-process client (it runs in another process, as
verifiers' harness programs do) reaches the same endpoint over HTTP on loopback
(``Loopback``: ``/r/<token>/v1/...`` and ``/r/<token>/inference/v1/generate``, the
process's key as the bearer token). The endpoint also answers vLLM's token-in
``/inference/v1/generate``, for clients that render the prompt themselves (verifiers'
training client): each such call is recorded as sampled (``TokenCall``), and the caller's
trace must agree with those records token for token (``roles.lib.envs.vf``).

The sampling of policy calls is the rollout's (``SamplingParams`` of the task request:
its temperature is the one the trainer divides by); a call may ask fewer tokens. The
number of policy calls is bounded by ``max_turns`` (a call past it is a 400 to the
agent). The rubric scores the messages ``run`` returns; ``state`` is the harness's.

How it ends (``Trace.stop_condition``, ``roles.lib.envs.stop``): ``run`` returned
(``schedule_exhausted``, whatever limits it met and handled on the way). A policy call
refused at a limit after the policy had spoken, the rollout's calls spent or the prompt
too long for the model (OpenAI's ``context_length_exceeded``), that ``run`` lets
propagate, ends the rollout as the harness's loop ends there (``max_turns_reached``,
``prompt_too_long``: truncated): scored on the conversation so far (the last call's
messages, its reply, what the refused call added), its calls trainable. Refused at the
first call, or failing otherwise, it is errored (``has_error``) as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from roles.lib.envs.base import Harness, Messages, State
from roles.lib.envs.stop import (
    HAS_ERROR,
    MAX_TURNS_REACHED,
    PROMPT_TOO_LONG,
    SCHEDULE_EXHAUSTED,
    stop_condition,
)
from roles.lib.model.render import Reply, TemplateError
from roles.lib.openai_api import (
    CONTEXT_LENGTH_EXCEEDED,
    ApiError,
    ChatRequest,
    Choice,
    TokensRequest,
    chat_messages,
    chat_response,
    failure_error,
    models_response,
    parse_request,
    tokens_response,
)
from schemas import GenerateResult, InferenceFailed, SamplingParams
from schemas.arrays import f32, i32

BASE_URL = "http://rollout.rlbus.invalid/v1"  # never resolved: the transport answers


class AgentHarness(Harness):
    """A harness whose ``run`` drives the conversation through an OpenAI client."""

    max_turns = 8  # policy calls a rollout may make

    async def run(self, client: Any, model: str, task: dict[str, Any], state: State) -> Messages:
        raise NotImplementedError


@dataclass
class PolicyCall:
    """One call to the policy, as sampled."""

    messages: Messages  # what the agent sent (rendered)
    prompt: list[int]
    result: GenerateResult
    reply: Reply
    said: dict[str, Any]  # the assistant message the agent got back
    pieces: list[tuple[list[int], tuple[int, int] | None]]  # new messages' tokens
    close: list[int]  # tokens closing the previous completion
    gen: list[int]  # generation prompt


@dataclass
class OtherCall:
    """A call to another model (a judge): recorded, never trained."""

    model: str
    messages: Messages
    result: GenerateResult
    reply: Reply


@dataclass
class TokenCall:
    """One token-in call (``/inference/v1/generate``): the caller rendered ``prompt``."""

    model: str
    prompt: list[int]
    result: GenerateResult


@dataclass
class RolloutEndpoint:
    """The OpenAI endpoint one rollout's agent talks to (an ``httpx`` transport)."""

    renderer: Any
    generate: Callable[..., Any]  # the harness's Generate
    sampling: SamplingParams
    policy: str
    models: Sequence[str]
    rollout_id: str
    seed: int
    env_id: str
    tools: Sequence[dict[str, Any]] = ()
    max_calls: int = 8
    calls: list[PolicyCall] = field(default_factory=list)
    others: list[OtherCall] = field(default_factory=list)
    # Token-in calls are served only where the caller's own trace is turned into the
    # rlbus trace (verifiers' envs, ``roles.lib.envs.vf``): an agent's chat calls are
    # recorded as its branch here, token-in calls could not be.
    token_in: bool = False
    token_calls: list[TokenCall] = field(default_factory=list)
    error: TemplateError | None = None
    # (stop condition, conversation so far) while the latest request was a policy call
    # refused at a limit after the policy had spoken: its calls spent
    # (``max_turns_reached``) or its prompt too long for the model (``prompt_too_long``).
    cut: tuple[str, Messages] | None = None

    def client(self) -> Any:
        """The official async client, bound to this rollout."""
        import httpx
        import openai

        transport = _Transport(self)
        return openai.AsyncOpenAI(base_url=BASE_URL, api_key=self.rollout_id, max_retries=0,
                                  http_client=httpx.AsyncClient(transport=transport))  # fmt: skip

    async def answer(self, path: str, raw: bytes) -> tuple[int, dict[str, Any]]:
        """(status, body) for one request."""
        self.cut = None
        try:
            if path.endswith("/chat/completions"):
                return 200, await self._chat(parse_request(ChatRequest, raw))
            if path.endswith("/inference/v1/generate") and self.token_in:
                return 200, await self._tokens(parse_request(TokensRequest, raw))
            if path.endswith("/v1/models"):
                return 200, models_response(self.models, 0)
            raise ApiError(404, f"{path}: a rollout's endpoint serves /v1/chat/completions, "
                           "/inference/v1/generate and /v1/models")  # fmt: skip
        except ApiError as e:
            return e.status, e.body()

    def _check_model(self, model: str) -> None:
        if model not in self.models:
            raise ApiError(404, f"model {model!r} is not one of the run's: {list(self.models)}",
                           param="model", code="model_not_found")  # fmt: skip

    def _policy_budget(self, asked: int | None) -> SamplingParams:
        """The rollout's sampling for one policy call (``asked``: fewer tokens), once the
        rollout has calls left."""
        if len(self.calls) + self._policy_token_calls() >= self.max_calls:
            raise ApiError(
                400, f"this rollout's {self.max_calls} policy calls are spent (max_turns)"
            )
        budget = min(asked or self.sampling.max_completion_tokens,
                     self.sampling.max_completion_tokens)  # fmt: skip
        return SamplingParams(temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                              top_k=self.sampling.top_k, max_completion_tokens=budget,
                              stop=self.sampling.stop)  # fmt: skip

    def _policy_token_calls(self) -> int:
        return sum(c.model == self.policy for c in self.token_calls)

    async def _tokens(self, req: TokensRequest) -> dict[str, Any]:
        """A token-in call: the policy's with the rollout's sampling (a call may ask fewer
        tokens), another model's with its own; recorded either way."""
        self._check_model(req.model)
        sp = req.sampling_params
        if req.model == self.policy:
            sampling = self._policy_budget(sp.max_tokens)
        else:
            sampling = SamplingParams(temperature=sp.temperature, top_p=sp.top_p,
                                      top_k=max(sp.top_k, 0),
                                      max_completion_tokens=sp.max_tokens or self.sampling.max_completion_tokens)  # fmt: skip
        vocab = len(self.renderer.tokenizer)
        if any(not 0 <= t < vocab for t in (*req.token_ids, *sp.stop_token_ids)):
            raise ApiError(400, f"token ids must be in [0, {vocab})", param="token_ids")
        k = len(self.calls) + len(self.others) + len(self.token_calls)
        prompt = list(req.token_ids)
        stops = list(sp.stop_token_ids) or list(self.renderer.stop_token_ids)
        result = await self._generate(req.model, k, prompt, sampling, stops)
        self.token_calls.append(TokenCall(req.model, prompt, result))
        return tokens_response(f"{self.rollout_id}-{k}", prompt, result)

    async def _chat(self, req: ChatRequest) -> dict[str, Any]:
        self._check_model(req.model)
        if req.n != 1:
            raise ApiError(400, "n: an agent's call samples one reply", param="n")
        messages = chat_messages(req.messages)
        if req.tools:  # kept for the later calls: the template showed them once
            self.tools = list(req.tools)
        tools = list(self.tools) or None
        k = len(self.calls) + len(self.others)
        if req.model != self.policy:  # a judge: its own sampling, recorded apart
            prompt = self.renderer.render_prompt(messages, tools)
            sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p,
                                      max_completion_tokens=req.budget(self.sampling.max_completion_tokens))  # fmt: skip
            result = await self._generate(req.model, k, prompt, sampling,
                                          self.renderer.stop_token_ids)  # fmt: skip
            reply = self.renderer.parse_reply(
                i32(result.completion_ids).tolist(), prompt, bool(tools)
            )
            self.others.append(OtherCall(req.model, messages, result, reply))
            return self._body(k, req.model, prompt, result, reply)
        try:
            sampling = self._policy_budget(req.budget(self.sampling.max_completion_tokens))
        except ApiError:
            self._refused(MAX_TURNS_REACHED, messages)
            raise
        close: list[int] = []
        if not self.calls:
            turn = self.renderer.first_turn(messages, tools)
        else:
            last = self.calls[-1]
            seen = [*last.messages, last.said]
            if len(messages) <= len(seen) or not _same(messages[: len(seen)], seen):
                self.error = TemplateError(
                    f"policy call {len(self.calls)} does not extend the conversation "
                    "(its messages rewrite what came before)"
                )
                raise ApiError(400, str(self.error))
            try:
                turn = self.renderer.next_turn(last.prompt, i32(last.result.completion_ids).tolist(),
                                               messages[len(seen) :], tools)  # fmt: skip
            except TemplateError as e:
                self.error = e
                raise ApiError(400, str(e)) from None
            close = turn.close
        try:
            result = await self._generate(self.policy, k, turn.prompt, sampling,
                                          self.renderer.stop_token_ids)  # fmt: skip
        except ApiError as e:
            if e.code == CONTEXT_LENGTH_EXCEEDED:
                self._refused(PROMPT_TOO_LONG, messages)
            raise
        completion = i32(result.completion_ids).tolist()
        reply = self.renderer.parse_reply(completion, turn.prompt, bool(tools))
        body = self._body(k, req.model, turn.prompt, result, reply)
        said = body["choices"][0]["message"]
        self.calls.append(PolicyCall(messages, turn.prompt, result, reply, said, turn.pieces,
                                     close, turn.gen))  # fmt: skip
        return body

    def _refused(self, stop: str, messages: Messages) -> None:
        """Remember a policy call refused at a limit (``cut``), once the policy has spoken:
        the conversation is the last call's and its reply, then what this call added."""
        if not self.calls:
            return
        last = self.calls[-1]
        seen = [*last.messages, last.said]
        extends = len(messages) >= len(seen) and _same(messages[: len(seen)], seen)
        self.cut = (stop, [*seen, *messages[len(seen) :]] if extends else seen)

    async def _generate(
        self, model: str, k: int, prompt: list[int], sampling: SamplingParams,
        stop_ids: Sequence[int],
    ) -> GenerateResult:  # fmt: skip
        from schemas import derive_id, stable_seed

        result = await self.generate(model, derive_id(self.rollout_id, "call", k), prompt, sampling,
                                     list(stop_ids), stable_seed(self.seed, "call", k),
                                     env=self.env_id)  # fmt: skip
        if isinstance(result, InferenceFailed):
            raise failure_error(result)
        return result

    def _body(
        self, k: int, model: str, prompt: list[int], result: GenerateResult, reply: Reply
    ) -> dict[str, Any]:
        ids = i32(result.completion_ids).tolist()
        choice = Choice(ids, f32(result.logprobs).tolist(), result.finish_reason, reply,
                        result.policy_version)  # fmt: skip
        return chat_response(f"{self.rollout_id}-{k}", model, prompt, [choice],
                             self.renderer.tokenizer, True)  # fmt: skip


def _same(a: Messages, b: Messages) -> bool:
    """Whether two message lists say the same (role, content, calls), as JSON does."""

    def norm(m: dict[str, Any]) -> Any:
        calls = [(c.get("function", c).get("name"), json.loads(c.get("function", c).get("arguments") or "{}"))
                 for c in m.get("tool_calls") or []]  # fmt: skip
        return (m.get("role"), m.get("content") or "", calls, m.get("tool_call_id"))

    return [norm(m) for m in a] == [norm(m) for m in b]


class _Transport:
    """An ``httpx.AsyncBaseTransport`` that answers from a ``RolloutEndpoint``."""

    def __new__(cls, endpoint: RolloutEndpoint) -> Any:
        import httpx

        class Transport(httpx.AsyncBaseTransport):
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                status, body = await endpoint.answer(request.url.path, await request.aread())
                return httpx.Response(status, json=body)

        return Transport()


class TimedGenerate:
    """The harness's Generate, timed (``timings``: the trace's generate/queue/compute
    seconds) with inference's failures kept (``failures``: the first is the rollout's
    error); a timeout is the agent's 504."""

    def __init__(self, generate: Callable[..., Any], clock: Callable[[], float]) -> None:
        from schemas import TraceError

        self.generate, self.clock = generate, clock
        self.timings = {"generate_s": 0.0, "env_s": 0.0, "queue_s": 0.0, "compute_s": 0.0}
        self.failures: list[TraceError] = []

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from bus.errors import RequestTimeout
        from schemas import TraceError

        t = self.clock()
        try:
            result = await self.generate(*args, **kwargs)
        except RequestTimeout as e:
            self.failures.append(TraceError(kind="inference_timeout", message=str(e)[:2000]))
            raise ApiError(504, f"inference did not answer: {e}") from None
        finally:
            self.timings["generate_s"] += self.clock() - t
        if isinstance(result, InferenceFailed):
            self.failures.append(TraceError(kind=result.kind, message=result.message[:2000]))
        else:
            self.timings["queue_s"] += result.queue_s
            self.timings["compute_s"] += result.compute_s
        return result


class Loopback:
    """Rollout endpoints over HTTP on 127.0.0.1, for agent code that cannot take an
    in-process client. One per process and event loop (``Loopback.get()``), started on
    first use; ``/r/<token>/...`` reaches the endpoint ``serve`` registered under
    ``<token>``, and every request needs ``Authorization: Bearer <key>`` (the process's
    random key; agent code reads it from the environment variable ``KEY_VAR``)."""

    KEY_VAR = "RLBUS_ROLLOUT_API_KEY"
    _instances: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Loopback] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self) -> None:
        import os

        self.key = os.environ.setdefault(self.KEY_VAR, secrets.token_hex(16))
        self.endpoints: dict[str, RolloutEndpoint] = {}
        self.base = ""
        self._runner: Any = None

    @classmethod
    async def get(cls) -> Loopback:
        loop = asyncio.get_running_loop()
        if loop not in cls._instances:
            server = cls()
            await server._start()
            cls._instances[loop] = server
        return cls._instances[loop]

    async def _start(self) -> None:
        import hmac

        from aiohttp import web

        async def handle(request: Any) -> Any:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.key}".encode()):
                error = ApiError(401, "a rollout endpoint needs its process's key",
                                 code="invalid_api_key")  # fmt: skip
                return web.json_response(error.body(), status=401)
            endpoint = self.endpoints.get(request.match_info["token"])
            if endpoint is None:
                error = ApiError(404, "no live rollout has this endpoint (it ended)")
                return web.json_response(error.body(), status=404)
            status, body = await endpoint.answer("/" + request.match_info["tail"],
                                                 await request.read())  # fmt: skip
            return web.json_response(body, status=status)

        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/r/{token}/{tail:.*}", handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.base = f"http://{host}:{port}"

    @contextlib.asynccontextmanager
    async def serve(self, endpoint: RolloutEndpoint) -> AsyncIterator[str]:
        """``endpoint`` reachable while the block runs; yields its base URL (``.../v1``)."""
        token = secrets.token_hex(8)
        self.endpoints[token] = endpoint
        try:
            yield f"{self.base}/r/{token}/v1"
        finally:
            del self.endpoints[token]


async def run_agent_rollout(
    env: Any,
    task: Any,
    generate: Callable[..., Any],
    renderer: Any,
    sampling: SamplingParams,
    *,
    rollout_id: str,
    model: str,
    name: str,
    env_id: str,
    group_id: str,
    sample_index: int,
    seed: int,
    models: Sequence[str],
    max_turns: int | None,
    clock: Callable[[], float],
    on_scored: Callable[[Messages, State], None] | None = None,
) -> Any:
    """One rollout of an ``AgentHarness`` env (module docstring) -> a ``Trace``: the
    policy's calls as one branch (their tokens exactly as sampled), other models' calls
    recorded beside it, the rubric's score of the messages ``run`` returns (handed to
    ``on_scored`` with the state, as ``run_rollout`` does)."""
    from roles.lib.envs.base import EnvCodeError
    from roles.lib.envs.chat import check_messages, state_columns
    from roles.lib.envs.harness import _Builder, scored
    from schemas import Branch, ToolCall, Trace, TraceError

    harness: AgentHarness = env.harness
    t_start = clock()
    timed = TimedGenerate(generate, clock)
    timings, failures = timed.timings, timed.failures
    endpoint = RolloutEndpoint(renderer, timed, sampling, model, models, rollout_id,
                               seed, env_id, env.tools, max_turns or harness.max_turns)  # fmt: skip
    data = task.data
    errors: list[TraceError] = []
    final: Messages = []
    score = None
    state_record: dict[str, Any] = {}
    ended: str | None = None  # why it ended (``roles.lib.envs.stop``); None: a failure
    try:
        state = harness.init_state(data)
        t = clock()
        try:
            returned = await harness.run(endpoint.client(), model, data, state)
        except EnvCodeError:
            raise
        except Exception:
            if endpoint.cut is None:
                raise
            # The policy was refused at a limit and the agent gave up: the rollout ends
            # there, scored on the conversation so far, as the harness's loop would.
            ended, final = endpoint.cut
        else:
            final, ended = check_messages(name, "run", returned), SCHEDULE_EXHAUSTED
        finally:
            timings["env_s"] += clock() - t - timings["generate_s"]
        score = scored(await env.ascore(final, data, state))
        state_record = state_columns(name, env.state_columns, state)
        if on_scored is not None:
            on_scored(final, state)
    except EnvCodeError:
        raise
    except Exception as e:  # the agent failed: because inference did, the template did, or its bug
        if failures:
            errors.append(failures[0])
        elif endpoint.error is not None:
            errors.append(TraceError(kind="render_error", message=str(endpoint.error)[:2000]))
        else:
            raise EnvCodeError.from_exception(name, e) from e
    if not errors and not endpoint.calls:
        errors.append(TraceError(kind="no_actor_turn", message=f"the agent never called {model!r}"))

    b = _Builder()
    previous: PolicyCall | None = None
    last = -1  # the previous call's assistant message
    for call in endpoint.calls:
        new = call.messages if previous is None else call.messages[len(previous.messages) + 1 :]
        if previous is not None:
            b.append_unsampled(last, call.close)
        for m, (toks, span) in zip(new, call.pieces, strict=True):
            b.add_env(m, toks, span)
        ids = i32(call.result.completion_ids).tolist()
        lps = f32(call.result.logprobs).tolist()
        tool_calls = [ToolCall(id=c["id"], name=c["function"]["name"],
                               arguments=c["function"]["arguments"])
                      for c in call.said.get("tool_calls") or []]  # fmt: skip
        last = b.add("assistant", call.reply.content, call.gen + ids,
                     sampled=[0] * len(call.gen) + [1] * len(ids),
                     logprobs=[0.0] * len(call.gen) + lps, temperature=sampling.temperature,
                     policy_version=call.result.policy_version, model=model,
                     version_spans=call.result.version_spans,
                     finish_reason=call.result.finish_reason, tool_calls=tool_calls,
                     reasoning=call.reply.reasoning)  # fmt: skip
        previous = call
    trained = list(range(len(b.items)))
    for other in endpoint.others:  # a judge's reply: its tokens, never in a branch
        ids = i32(other.result.completion_ids).tolist()
        b.add("assistant", other.reply.content, ids, model=other.model,
              policy_version=other.result.policy_version, finish_reason=other.result.finish_reason)  # fmt: skip
    versions = [v for c in endpoint.calls for v in c.result.versions()]
    timings["total_s"] = clock() - t_start
    ok = not errors and score is not None
    stop = stop_condition(HAS_ERROR if not ok else None, ended)
    return Trace(
        rollout_id=rollout_id, env=name, task=task, group_id=group_id, sample_index=sample_index,
        messages=b.messages(), branches=[Branch(messages=trained)] if trained else [],
        reward=float(score.reward) if ok and score else 0.0,
        rewards=dict(score.rewards) if ok and score else {},
        metrics=dict(score.metrics) if ok and score else {},
        timings=timings, errors=errors, policy_min=min(versions, default=0),
        policy_max=max(versions, default=0),
        truncated=stop == PROMPT_TOO_LONG
        or any(c.result.finish_reason == "length" for c in endpoint.calls),
        num_turns=len(endpoint.calls), from_policy=bool(versions),
        state=state_record if ok else {}, stop_condition=stop,
    )  # fmt: skip
