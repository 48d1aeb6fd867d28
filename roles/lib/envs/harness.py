"""One rollout, token in / token out: an env, a task and a ``generate`` coroutine -> a ``Trace``.

The prompt of the first turn is ``renderer.first_turn(opening messages)``; every later
prompt is ``renderer.next_turn(previous prompt, completion, env's new messages)``: the
previous prompt and completion as they were, then the new messages in the template's
framing (``roles.lib.model.render``), so no turn is ever re-tokenised from text. Every token the model saw is attributed to
exactly one message of the trace:

- an opening message (system, user) gets its own rendered tokens;
- an assistant message gets the generation-prompt tokens (``<|assistant|>``), then the
  sampled completion (``sampled`` = 1, with its logprobs), then, if the conversation
  goes on, what closes it in the next prompt (not sampled): ``<|end|>`` when it was cut
  off, the newline Qwen3's template writes after ``<|im_end|>``;
- an env message (user/tool feedback) gets its rendered tokens;
- messages after the last generation (an env's closing remark) get no tokens: the model
  never saw them.

Env-provided messages with tokens (the opening messages, and user/tool feedback in the
loop) also record ``content_span`` = [start, end) of their content's tokens inside
``token_ids`` (``Renderer.split_scaffold``): for the char tokenizer's
``<|tool|>calc:46<|end|>`` that is just ``46``, not the role, name, colon or ``<|end|>``.
It stays None where it cannot be known exactly: an opening message that also carries
tokens the template added (a bos, a default system prompt), a template that does not
place content verbatim, assistant messages (their ``sampled`` mask says what is theirs)
and closing remarks (no tokens).

So for every branch, concatenating its messages' ``token_ids`` is the full sequence the
model saw last (final prompt + final completion), and ``token_ids``/``sampled``/
``logprobs`` have equal lengths per message.

Turns. Assistant turn ``k`` is written by ``env.speaker(k)`` (a member, in a multi-agent
env: its ``schedule``, else round robin). The rollout ends after the schedule's last turn
or after ``max_turns`` turns (``env.turn_limit``: the request's, else the env's own),
without asking the env, or when the env says done after a turn (``env_response``). A done
before ``env.min_turns`` turns is overridden: the env's messages are rendered as feedback
and the next turn is generated.

Tool calls. Each completion is read back by ``renderer.parse_reply`` into (content,
reasoning, calls); the reasoning (``Message.reasoning``) reaches the env as the chat
dict's ``reasoning_content``; every call gets the id ``derive_id(rollout_id, "turn",
turn, "call", k)``, is recorded in ``Message.tool_calls`` and reaches the env in the chat dict's
``tool_calls`` (OpenAI-style). A tool message the env writes records its
``tool_call_id``, and gets its call's ``name`` when the env gave none (before it is
rendered, so the model sees the name the template writes, and SFT by tool name works).
Parsing never touches tokens: the sampled ids are recorded as they are.

Turn errors. A reply that starts a tool call that does not parse, or that the env's
``env_response`` refuses with ``ParseError``, is masked (``Message.masked``: its tokens
never train) and recorded in ``Trace.turn_errors`` (``parse_error``, with the message
id); the rollout goes on (the env sees the raw reply and answers it; a ``ParseError``
goes on with its ``feedback``, or ends the rollout without one). The trace stays ``ok``.

How it ends (``Trace.stop_condition``, ``roles.lib.envs.stop``): the env said done or
its schedule's last turn was taken (``schedule_exhausted``), or the last turn
``max_turns`` allows was taken (``max_turns_reached``: the env is not asked after it, so
a rollout that uses every turn is this even if the env had nothing more to say), or the
next prompt outgrew the model's context (``prompt_too_long``), or it failed
(``has_error``: an error outranks whatever else held). A prompt inference
refuses as ``context_too_long`` after at least one turn ends the rollout truncated
(``Trace.truncated``) and scored, its turns trainable: the env's messages of that prompt
stay in the conversation the rubric scores, with no tokens (the model never read them),
and the last reply loses the tokens that closed it there. At the first turn nothing was
generated: it is an error, as below (also when the actor's seat never came).

Failures. A retryable failure becomes a ``Trace`` with ``errors`` set and reward 0: an
inference timeout, a transport error (``inference_error``), an ``InferenceFailed``
reply (e.g. ``context_too_long`` at the first turn), a malformed reply (``bad_reply``),
a rollout the actor never spoke in (``no_actor_turn``). A bug in env code is not retryable: an
exception from ``initial_messages``, ``init_state``, ``env_response`` (but
``ParseError``) or ``score``, messages that are not chat dicts, a partial
``member_rewards``, or a state column that is missing or not JSON-able raises
``EnvCodeError`` (with the traceback) out of ``run_rollout``; the env server
dead-letters the task. ``CancelledError`` propagates too.

After scoring, the env's ``state_columns`` are copied from its state into
``Trace.state`` (as JSON would give them back, so the log and a replay agree; a column
the state does not hold is None). An env with a group rubric is scored once more, with
its group, by the env server (``roles.lib.envs.group``).

    trace = await run_rollout(env, TaskRef(index=0, data=env.task("train", 0)), client_generate,
                              Renderer(tokenizer), SamplingParams(), rollout_id="r0", seed=1)
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from bus.errors import RequestTimeout
from configs.orchestrator import POLICY
from roles.lib.envs.base import EnvCodeError, Environment, Messages, ParseError, Score, State
from roles.lib.envs.chat import (
    chat_calls,
    check_messages,
    check_response,
    reply_calls,
    resolve_tool_names,
    state_columns,
)
from roles.lib.envs.seats import Cast, cast
from roles.lib.envs.stop import (
    CONTEXT_TOO_LONG,
    HAS_ERROR,
    MAX_TURNS_REACHED,
    PROMPT_TOO_LONG,
    SCHEDULE_EXHAUSTED,
    stop_condition,
)
from roles.lib.model.render import TemplateError
from schemas import (
    Branch,
    GenerateResult,
    InferenceFailed,
    Message,
    SamplingParams,
    Seating,
    TaskRef,
    ToolCall,
    Trace,
    TraceError,
    derive_id,
    stable_seed,
)
from schemas.arrays import f32, i32, pack_f32, pack_i32, pack_mask


class Generate(Protocol):
    """``InferenceClient.generate``'s signature, plus the asking env's name."""

    def __call__(
        self,
        model: str,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        stop_token_ids: Sequence[int],
        seed: int,
        *,
        env: str | None = None,
    ) -> Awaitable[GenerateResult | InferenceFailed]: ...


class _Failure(Exception):
    """Ends the rollout loop with a recorded error."""

    def __init__(self, kind: str, message: str, message_id: int | None = None) -> None:
        super().__init__(message)
        self.error = TraceError(kind=kind, message=message[:2000], message_id=message_id)


class _Builder:
    """The trace's messages, in order, each with its token arrays (kept as lists until the end)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def add(
        self,
        role: str,
        content: str,
        tokens: Sequence[int],
        sampled: Sequence[int] | None = None,
        logprobs: Sequence[float] | None = None,
        **fields: Any,
    ) -> int:
        n = len(tokens)
        self.items.append(
            {
                "role": role,
                "content": content,
                "tokens": list(tokens),
                "sampled": list(sampled) if sampled is not None else [0] * n,
                "logprobs": list(logprobs) if logprobs is not None else [0.0] * n,
                "fields": fields,
            }
        )
        return len(self.items) - 1

    def add_env(
        self, m: dict[str, Any], tokens: Sequence[int], content_span: tuple[int, int] | None = None
    ) -> int:
        """A chat message the env wrote (system, user, tool), none of its tokens sampled."""
        content = str(m.get("content") or "")
        return self.add(m["role"], content, tokens, name=m.get("name"),
                        tool_call_id=m.get("tool_call_id"), content_span=content_span)  # fmt: skip

    def mask(self, index: int) -> bool:
        """Mark a reply as masked; False if it already was."""
        fields = self.items[index]["fields"]
        was = fields.get("masked", False)
        fields["masked"] = True
        return not was

    def append_unsampled(self, index: int, tokens: Sequence[int]) -> None:
        item = self.items[index]
        item["tokens"] += tokens
        item["sampled"] += [0] * len(tokens)
        item["logprobs"] += [0.0] * len(tokens)

    def unsee(self, index: int, close: int) -> None:
        """Take back a prompt the model never read: the ``close`` tokens that closed reply
        ``index`` in it, and the tokens of every message after that reply (they stay, as
        closing remarks do, with no tokens)."""
        item = self.items[index]
        for key in ("tokens", "sampled", "logprobs"):
            del item[key][len(item[key]) - close :]
        for later in self.items[index + 1 :]:
            later["tokens"], later["sampled"], later["logprobs"] = [], [], []
            later["fields"]["content_span"] = None

    def messages(self) -> list[Message]:
        out = []
        for i, item in enumerate(self.items):
            extra = {k: v for k, v in item["fields"].items() if k in _MESSAGE_FIELDS}
            out.append(
                Message(
                    id=i,
                    role=item["role"],
                    content=item["content"],
                    parent=i - 1 if i else None,
                    token_ids=pack_i32(item["tokens"]),
                    sampled=pack_mask(item["sampled"]),
                    logprobs=pack_f32(item["logprobs"]),
                    **extra,
                )
            )
        return out


_MESSAGE_FIELDS = {
    "name",
    "temperature",
    "policy_version",
    "version_spans",
    "model",
    "finish_reason",
    "content_span",
    "member",
    "tool_calls",
    "tool_call_id",
    "masked",
    "reasoning",
}


async def run_rollout(
    env: Environment,
    task: TaskRef,
    generate: Generate,
    renderer: Any,
    sampling: SamplingParams,
    *,
    rollout_id: str,
    model: str = "policy",
    env_name: str | None = None,
    env_id: str | None = None,
    group_id: str = "",
    sample_index: int = 0,
    seed: int = 0,
    max_turns: int | None = None,
    seating: Seating | None = None,
    group_seed: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
    agent_models: Sequence[str] = (POLICY,),
    on_scored: Callable[[Messages, State], None] | None = None,
) -> Trace:
    """Run one rollout of ``task`` (its ``data`` is the env's task dict) and record it.

    ``model`` is the actor; in a multi-agent env each member's turns go to the model
    ``seating`` casts it to (``roles.lib.envs.seats``, seats drawn from ``group_seed``,
    the group's seed, and ``sample_index``), only the policy's turns count in
    ``policy_min``/``policy_max`` (staleness is about the policy's tokens; a trace with
    none, e.g. a frozen actor's, has ``from_policy`` False), and only the
    members that train get a branch. A rollout in which the actor never spoke is errored
    (``no_actor_turn``): nothing of it could train.

    ``env_name`` is recorded as ``Trace.env`` (the env's subject key); ``env_id`` (default:
    the same) is what each ``GenerateRequest.env`` says, so a scripted teacher can
    ``make_env`` it. Raises ``EnvCodeError`` for a bug in env code (module docstring).
    ``on_scored(messages, state)`` gets what the rubric scored, once the rollout is
    scored (a group rubric scores it again with its siblings: ``roles.lib.envs.group``).
    """
    name = env_name or env.name
    from roles.lib.envs.agent import AgentHarness, run_agent_rollout
    from roles.lib.envs.vf import VerifiersHarness, run_verifiers_rollout

    if isinstance(env.harness, VerifiersHarness):  # a verifiers env: its episode, checked
        return await run_verifiers_rollout(
            env, task, generate, renderer, sampling, rollout_id=rollout_id, model=model,
            name=name, env_id=env_id or name, group_id=group_id, sample_index=sample_index,
            seed=seed, models=agent_models, max_turns=max_turns, clock=clock,
        )  # fmt: skip
    if isinstance(env.harness, AgentHarness):  # env code drives the conversation itself
        return await run_agent_rollout(
            env, task, generate, renderer, sampling, rollout_id=rollout_id, model=model,
            name=name, env_id=env_id or name, group_id=group_id, sample_index=sample_index,
            seed=seed, models=agent_models, max_turns=max_turns, clock=clock,
            on_scored=on_scored,
        )  # fmt: skip
    turns = env.turn_limit(max_turns)
    t_start = clock()
    timings = {"generate_s": 0.0, "env_s": 0.0, "queue_s": 0.0, "compute_s": 0.0}
    b = _Builder()
    chat: Messages = []
    errors: list[TraceError] = []
    turn_errors: list[TraceError] = []
    calls: dict[str, ToolCall] = {}  # every call of the rollout, by id
    versions: list[int] = []  # weights versions of the policy's turns
    actor_turns = 0
    truncated = False
    num_turns = 0
    ended: str | None = None  # why the loop ended (``roles.lib.envs.stop``); None: a failure
    too_long: _Failure | None = None  # inference's refusal of a later turn's prompt
    last, closed = -1, 0  # the last reply's message, and the tokens closing it in the prompt
    reward, rewards, metrics = 0.0, {}, {}
    member_rewards: dict[str, float] = {}
    state_record: dict[str, Any] = {}
    data = task.data
    roles = Cast({}, None, ())

    def env_call(fn: Callable[..., Any], *args: Any, parse_errors: bool = False) -> Any:
        t = clock()
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - env code is user code: its bug, with its traceback
            if parse_errors and isinstance(e, ParseError):
                raise
            raise EnvCodeError.from_exception(name, e) from e
        finally:
            timings["env_s"] += clock() - t

    def mask_turn(index: int, reason: str) -> None:
        if b.mask(index):  # one turn error per reply, the first reason found
            turn_errors.append(
                TraceError(kind="parse_error", message=reason[:2000], message_id=index)
            )

    try:
        roles = cast(env, seating, model, seed if group_seed is None else group_seed, sample_index)
        chat = check_messages(name, "initial_messages", env_call(env.initial_messages, data))
        state = env_call(env.init_state, data)
        turn = renderer.first_turn(chat, env.tools)
        prompt, gen_prefix = turn.prompt, turn.gen
        for m, (toks, span) in zip(chat, turn.pieces, strict=True):
            b.add_env(m, toks, span)
        while True:
            request_id = derive_id(rollout_id, "turn", num_turns)
            member = env_call(env.speaker, num_turns)
            turn_model = roles.models.get(member, model) if member is not None else model
            t = clock()
            try:
                result = await generate(
                    turn_model,
                    request_id,
                    prompt,
                    sampling,
                    renderer.stop_token_ids,
                    stable_seed(seed, "turn", num_turns),
                    env=env_id or name,
                )
            except RequestTimeout as e:
                raise _Failure("inference_timeout", str(e)) from e
            except Exception as e:  # noqa: BLE001 - e.g. the connection closed under us
                raise _Failure("inference_error", f"{type(e).__name__}: {e}") from e
            finally:
                timings["generate_s"] += clock() - t
            if isinstance(result, InferenceFailed):
                if result.kind == CONTEXT_TOO_LONG and num_turns:
                    # The conversation outgrew the context: it ends here, truncated and
                    # scored; the prompt the model could not read keeps no tokens.
                    too_long, ended = _Failure(result.kind, result.message), PROMPT_TOO_LONG
                    b.unsee(last, closed)
                    break
                raise _Failure(result.kind, result.message)
            completion = i32(result.completion_ids).tolist()
            lps = f32(result.logprobs).tolist()
            if len(lps) != len(completion):
                raise _Failure(
                    "bad_reply", f"{len(completion)} completion tokens but {len(lps)} logprobs"
                )
            timings["queue_s"] += result.queue_s
            timings["compute_s"] += result.compute_s
            actor_turns += turn_model == model
            if turn_model == POLICY:  # staleness is about the trained policy's tokens only
                versions += result.versions()
            truncated = truncated or result.finish_reason == "length"
            # Only an env with tools reads calls: elsewhere a stray call marker is text.
            reply = renderer.parse_reply(completion, prompt, bool(env.tools))
            content, turn_calls, parse_error = reply_calls(reply, rollout_id, num_turns)
            last = b.add(
                "assistant",
                content,
                gen_prefix + completion,
                sampled=[0] * len(gen_prefix) + [1] * len(completion),
                logprobs=[0.0] * len(gen_prefix) + lps,
                temperature=sampling.temperature,
                policy_version=result.policy_version,
                version_spans=result.version_spans,
                model=turn_model,
                member=member,
                finish_reason=result.finish_reason,
                tool_calls=turn_calls,
                reasoning=reply.reasoning,
            )
            if parse_error is not None:
                mask_turn(last, parse_error)
            calls.update((c.id, c) for c in turn_calls)
            said: dict[str, Any] = {"role": "assistant", "content": content}
            if reply.reasoning is not None:
                said["reasoning_content"] = reply.reasoning
            if turn_calls:
                said["tool_calls"] = chat_calls(turn_calls)
            chat.append(said)
            num_turns += 1
            scheduled = bool(env.schedule) and num_turns >= len(env.schedule)
            if scheduled or num_turns >= turns:  # the env is not asked after this turn
                ended = stop_condition(
                    SCHEDULE_EXHAUSTED if scheduled else None,  # no member is left to speak
                    MAX_TURNS_REACHED if num_turns >= turns else None,
                )
                break
            try:
                response = env_call(env.env_response, chat, data, state, parse_errors=True)
            except ParseError as e:
                mask_turn(last, str(e))
                response = ([], True) if e.feedback is None else (e.feedback, False)
            new, done = check_response(name, response)
            new = resolve_tool_names(new, calls)
            if done and num_turns < env.min_turns:
                done = False  # too soon: its messages are feedback and the next turn comes
            if done:  # closing remarks: part of the conversation, never seen by the model
                for m in new:
                    b.add_env(m, [])
                chat.extend(new)
                ended = SCHEDULE_EXHAUSTED
                break
            try:
                turn = renderer.next_turn(prompt, completion, new, env.tools)
            except TemplateError as e:
                raise _Failure("render_error", str(e)) from e
            b.append_unsampled(last, turn.close)
            closed = len(turn.close)
            for m, (toks, span) in zip(new, turn.pieces, strict=True):
                b.add_env(m, toks, span)
            chat.extend(new)
            prompt, gen_prefix = turn.prompt, turn.gen
        if roles.trains and not actor_turns:
            if too_long is not None:  # the context ran out before the actor's seat came
                raise too_long
            raise _Failure(
                "no_actor_turn",
                f"{model!r} (members {list(roles.trains)}) never spoke in {num_turns} turns: "
                "is max_turns smaller than the turns before its seat?",
            )
        t_score = clock()
        try:  # (reward functions may be async: a judge asking a model)
            score = scored(await env.ascore(chat, data, state))
        except Exception as e:  # noqa: BLE001 - env code is user code: its bug, with its traceback
            raise EnvCodeError.from_exception(name, e) from e
        finally:
            timings["env_s"] += clock() - t_score
        reward, rewards, metrics = score.reward, dict(score.rewards), dict(score.metrics)
        member_rewards = dict(score.member_rewards)
        missing = [m for m in env.members if member_rewards and m not in member_rewards]
        if missing:  # a partial reward would silently fall back to the trace's
            raise EnvCodeError(
                name,
                "ValueError",
                f"scored members {sorted(member_rewards)} but not {missing}: "
                "a multi-agent rubric rewards every member or none",
            )
        state_record = state_columns(name, env.state_columns, state)
        if on_scored is not None:
            on_scored(chat, state)
    except _Failure as f:
        errors.append(f.error)
    except EnvCodeError:
        raise
    except Exception as e:  # noqa: BLE001 - the harness's own failure: recorded, never a crash
        errors.append(TraceError(kind="harness_exception", message=f"{type(e).__name__}: {e}"))
    timings["total_s"] = clock() - t_start
    messages = b.messages()
    stop = stop_condition(HAS_ERROR if errors else None, ended)
    return Trace(
        rollout_id=rollout_id,
        env=name,
        task=task,
        group_id=group_id,
        sample_index=sample_index,
        messages=messages,
        branches=branches_of(env, messages, roles.trains),
        reward=0.0 if errors else float(reward),
        member_rewards={} if errors else member_rewards,
        rewards={} if errors else rewards,
        metrics={} if errors else metrics,
        timings=timings,
        errors=errors,
        policy_min=min(versions, default=0),
        policy_max=max(versions, default=0),
        truncated=truncated or stop == PROMPT_TOO_LONG,
        num_turns=num_turns,
        seat=roles.learner,
        member_models=roles.models,
        from_policy=bool(versions),
        turn_errors=turn_errors,
        state={} if errors else state_record,
        stop_condition=stop,
    )


def scored(score: Any) -> Score:
    """A rubric's result, checked: a ``Score`` of finite floats (else the env's bug)."""
    if not isinstance(score, Score):
        raise TypeError(f"score() returned {score!r}, not a Score")
    values = [score.reward, *score.rewards.values(), *score.metrics.values(),
              *score.member_rewards.values()]  # fmt: skip
    if not all(isinstance(v, numbers.Real) and math.isfinite(v) for v in values):
        raise ValueError(f"score() returned a value that is not a finite number: {score!r}")
    return score


def branches_of(env: Environment, messages: list[Message], trains: Sequence[str]) -> list[Branch]:
    """One branch over every message; a multi-agent env gets one per member that trains
    (``trains``), each training only that member's turns
    (``roles.algorithm.samples.branch_masks``): a judge's or a frozen opponent's turns
    never become a sample."""
    ids = [m.id for m in messages]
    if not env.members:
        return [Branch(messages=ids)]
    return [Branch(messages=ids, member=member) for member in trains]


def completion_tokens(trace: Trace) -> int:
    """How many tokens were sampled in ``trace`` (by every model that played in it)."""
    return sum(sum(m.sampled) for m in trace.messages)  # bytes of 0/1
