"""verifiers environments, unchanged: ``vf:<module>`` runs a verifiers (v1) taskset in rlbus.

    [[orchestrator.train.env]]
    id = "vf:my_tasks"            # a module exporting one vf.Taskset subclass in __all__
    args = {num_tasks = 200}      # its TasksetConfig fields
    # args.vf_env = {...}         # optional: verifiers' EnvConfig (an Env id, agents' harness)

``pip install 'rlbus[verifiers]'`` installs the supported version (verifiers 0.4, whose
API is ``verifiers.v1``); nothing here imports it until a ``vf:`` env is built.

One rollout is one verifiers episode, run as verifiers runs it for prime-rl: the env's
``run_episode`` with a *training* client (``TrainClientConfig``), so verifiers renders
every prompt itself (the ``renderers`` package, the same renderer as the run's:
``model.renderer``) and asks for completions token in, token out. The client's base URL
is this rollout's endpoint (``roles.lib.envs.agent.RolloutEndpoint`` over ``Loopback``):
each call becomes a generate request on the bus with the rollout's sampling, and is
recorded as sampled. The episode's agents run verifiers' tool-less chat loop (the
``null`` harness, in a local subprocess) unless ``vf_env`` names another; a taskset's
tools are verifiers' MCP tool servers. The first rollout of a process prepares that
program's environment with ``uv`` (installed with the extra), once per machine.

The episode becomes the rlbus trace (``episode_trace``): every node of its message
graph a message (tokens, sampled mask), each trainable agent's root-to-leaf branch a
branch. Nothing trains that rlbus did not sample: each sampled message must be the
completion of a recorded call whose prompt is exactly the tokens before it on its
branch, and its logprobs and policy version are the recorded call's; a trace that
disagrees is errored (``render_error``). An episode that failed because env code raised
(a reward, a task hook, the env's ``run``, a toolset) is a bug in env code
(``EnvCodeError``: the task is dead-lettered); one that failed otherwise (verifiers'
program, a refused model call) is errored (``harness_error``). The reward, the named
rewards and the metrics are verifiers' (its rubric runs inside the episode);
``stop_condition`` and the fields of the task's ``vf.State`` are the trace's state
columns (and any field a run's config adds: ``state_columns``). verifiers' stop
condition is also the trace's, by rlbus's name (``stop_of``: ``agent_completed`` is
``schedule_exhausted``, ``max_turns`` is ``max_turns_reached``, ...). Unlike the
harness's loop, a model call that inference refuses as too long still errors the
rollout at any turn (``context_too_long``): verifiers saw its model call fail, and its
rewards are computed inside the episode, which rlbus cannot score again.

Rubric replay cannot rescore a verifiers env (its reward functions read verifiers'
trace, which is not kept): ``rlbus replay <run> rubric`` names such traces as failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from roles.lib.envs.agent import AgentHarness, Loopback, RolloutEndpoint, TimedGenerate, TokenCall
from roles.lib.envs.base import Environment, ListTaskset, Messages, Rubric, State
from roles.lib.envs.stop import (
    HAS_ERROR,
    MAX_TURNS_REACHED,
    PROMPT_TOO_LONG,
    SCHEDULE_EXHAUSTED,
    stop_condition,
)
from schemas import SamplingParams

PREFIX = "vf:"
RESERVED = "vf_env"  # the arg naming verifiers' EnvConfig beside the taskset's fields
INSTALL = "pip install 'rlbus[verifiers]'"
# verifiers' errors that say env code raised (a task's hook or reward, the env's run, a
# toolset): a bug, which stops the run as any env bug does (``EnvCodeError``). The others
# (its program exited, a model call failed, a timeout) fail only the rollout.
ENV_CODE_ERRORS = ("TaskError", "EnvError", "ToolsetError")
# verifiers' limits (its ``Trace.stop_condition``), by the rlbus stop condition they are:
# the context outgrown, or the episode's own length or time budget spent.
CONTEXT_LIMITS = ("max_input_tokens", "max_total_tokens", "compaction_failed")
LENGTH_LIMITS = ("max_turns", "max_output_tokens")


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(f"verifiers envs need the verifiers package: {INSTALL} ({e})") from None
    return vf


def load(module: str, args: dict[str, Any]) -> Environment:
    """The rlbus Environment running verifiers taskset ``module`` with ``args``."""
    vf = _vf()
    plugin = _plugin_id(module)
    args = dict(args)
    env_config = dict(args.pop(RESERVED, None) or {})
    taskset = {**dict(env_config.pop("taskset", None) or {}), **args, "id": plugin}
    env_config = _local_agents(vf.env_config_type(plugin, env_config.get("id", "")), env_config)
    venv = vf.load_environment(vf.resolve_env_config({**env_config, "taskset": taskset}))
    return wrap(venv, PREFIX + module, {**args, **({RESERVED: env_config} if env_config else {})})


def from_object(obj: Any, name: str, args: dict[str, Any]) -> Environment | None:
    """What a user's ``load_environment`` returned, if it is verifiers' (a ``vf.Env``, or
    a ``vf.Taskset`` played by one agent as ``vf:`` does), as an rlbus Environment."""
    vf = sys.modules.get("verifiers.v1")
    if vf is None:
        return None
    if isinstance(obj, vf.Env):
        return wrap(obj, name, args)
    if not isinstance(obj, vf.Taskset):
        return None
    plugin = _plugin_id(type(obj).__module__)
    config = _local_agents(vf.env_config_type(plugin), {})
    taskset = {**obj.config.model_dump(), "id": plugin}
    venv = vf.load_environment(vf.resolve_env_config({**config, "taskset": taskset}))
    venv.taskset = obj  # the user's own instance, as configured
    return wrap(venv, name, args)


def _local_agents(config_type: Any, env_config: dict[str, Any]) -> dict[str, Any]:
    """``env_config`` with every agent the env declares running verifiers' tool-less chat
    loop (unless the env or the config names a harness) in a local subprocess."""
    vf = _vf()
    env_config = dict(env_config)
    for name, field in config_type.model_fields.items():
        if isinstance(field.default, vf.AgentConfig):
            agent = dict(env_config.get(name) or {})
            if field.default.harness is None:
                agent.setdefault("harness", {"id": "null"})
            agent.setdefault("runtime", {"type": "subprocess"})
            env_config[name] = agent
    return env_config


def wrap(venv: Any, name: str, args: dict[str, Any]) -> Environment:
    """The rlbus Environment playing verifiers env ``venv``: its tasks (an infinite
    taskset: its first 10,000), the harness that runs its episodes."""
    source = venv.taskset if venv.taskset.bounded else venv.taskset.take(10_000)
    tasks = {t.key: t for t in source}
    rows = [{"vf_key": key, "prompt": t.data.prompt_text} for key, t in tasks.items()]
    harness = VerifiersHarness(venv, tasks, _state_fields(type(venv.taskset).task_type()))
    return Environment(
        name,
        ListTaskset(rows),
        harness,
        Rubric({"verifiers": _not_rescorable}),
        args,
        state_columns=("stop_condition", *harness.state_fields),
    )


def _plugin_id(module: str) -> str:
    """``module`` as verifiers names plugins: one importable name without dots (it looks a
    dotted one up inside its own package). A dotted module is imported here and known to
    verifiers under its path with ``_`` for ``.``."""
    if "." not in module:
        return module
    import importlib

    alias = module.replace(".", "_")
    sys.modules.setdefault(alias, importlib.import_module(module))
    return alias


def _state_fields(task_type: Any) -> tuple[str, ...]:
    """The fields of ``task_type``'s ``vf.State`` (verifiers' own ``artifacts`` aside)."""
    from verifiers.v1.state import state_cls

    return tuple(f for f in state_cls(task_type).model_fields if f != "artifacts")


def _not_rescorable(messages: Messages, task: dict[str, Any], state: State) -> float:
    raise NotImplementedError(
        "a verifiers env is scored inside verifiers' episode (its reward functions read "
        "verifiers' trace, which rlbus does not keep): rubric replay cannot rescore it"
    )


class VerifiersHarness(AgentHarness):
    """The verifiers env behind a ``vf:`` Environment (``run_verifiers_rollout`` runs it)."""

    max_turns = 32  # model calls an episode may make (``max_turns`` of the request wins)

    def __init__(self, venv: Any, tasks: dict[str, Any], state_fields: tuple[str, ...]) -> None:
        super().__init__()
        self.venv, self.tasks, self.state_fields = venv, tasks, state_fields
        self._serving: contextlib.AsyncExitStack | None = None
        self._starting = asyncio.Lock()  # the env server runs rollouts concurrently

    async def serving(self) -> None:
        """verifiers' shared resources (tool servers), started once per process by the
        first rollout (the others wait for it)."""
        async with self._starting:
            if self._serving is None:
                _share_import_path()
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(self.venv.serving())
                self._serving = stack

    async def episode(self, task: dict[str, Any], model: str, base_url: str, renderer: Any) -> Any:
        """One verifiers episode of ``task`` against the endpoint at ``base_url``."""
        vf = _vf()
        from verifiers.v1.configs.client import TrainClientConfig

        await self.serving()
        client = TrainClientConfig(base_url=base_url, api_key_var=Loopback.KEY_VAR,
                                   renderer_model_name=renderer.tokenizer.name_or_path,
                                   renderer=renderer.config)  # fmt: skip
        ctx = vf.ModelContext(model=model, client=client, sampling=vf.SamplingConfig())
        return await self.venv.run_episode(self.tasks[task["vf_key"]], ctx)


def _share_import_path() -> None:
    """verifiers starts tool servers as ``python -m <module>``: they find the user's
    modules where this process does (its working directory first, as ``rlbus`` does)."""
    path = [p or os.getcwd() for p in sys.path]
    have = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*have.split(os.pathsep), *path]))


async def run_verifiers_rollout(
    env: Environment,
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
) -> Any:
    """One rollout of a ``vf:`` env -> a ``Trace`` (module docstring)."""
    from roles.lib.envs.base import EnvCodeError
    from schemas import Trace

    harness: VerifiersHarness = env.harness  # type: ignore[assignment]
    if getattr(renderer, "config", None) is None:
        raise EnvCodeError(name, "ValueError", "a verifiers env needs a model of a family the "
                           "`renderers` package renders (model.path or model.tiny.arch), not "
                           "the character model (model.renderer = rlbus)")  # fmt: skip
    t_start = clock()
    timed = TimedGenerate(generate, clock)
    timings = timed.timings
    endpoint = RolloutEndpoint(renderer, timed, sampling, model, models, rollout_id,
                               seed, env_id, max_calls=max_turns or harness.max_turns,
                               token_in=True)  # fmt: skip
    loopback = await Loopback.get()
    async with loopback.serve(endpoint) as base_url:
        try:
            episode = await harness.episode(task.data, model, base_url, renderer)
        except Exception as e:  # noqa: BLE001 - verifiers raising outside its episode: env code
            raise EnvCodeError.from_exception(name, e) from e
    timings["env_s"] = clock() - t_start - timings["generate_s"]
    built = episode_trace(episode, endpoint.token_calls, model, sampling.temperature)
    if built.bug is not None and not timed.failures:
        raise EnvCodeError(name, *built.bug)
    errors = timed.failures[:1] or built.errors
    versions = built.versions
    timings["total_s"] = clock() - t_start
    ok = not errors
    stop = stop_condition(HAS_ERROR if not ok else None, _stop_of(episode) if ok else None)
    return Trace(
        rollout_id=rollout_id, env=name, task=task, group_id=group_id, sample_index=sample_index,
        messages=built.messages, branches=built.branches if ok else [],
        reward=built.reward if ok else 0.0, rewards=built.rewards if ok else {},
        metrics=built.metrics if ok else {}, timings=timings, errors=errors,
        policy_min=min(versions, default=0), policy_max=max(versions, default=0),
        truncated=built.truncated or stop == PROMPT_TOO_LONG, num_turns=len(versions),
        from_policy=bool(versions), stop_condition=stop,
        state=_state_record(episode, env.state_columns) if ok else {},
    )  # fmt: skip


class Bug(NamedTuple):
    """A bug in env code found in an episode (``EnvCodeError``'s fields)."""

    error_type: str
    message: str
    traceback: str = ""


class Built:
    """An episode as rlbus records it (``episode_trace``)."""

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.branches: list[Any] = []
        self.errors: list[Any] = []
        self.versions: list[int] = []
        self.reward = 0.0
        self.rewards: dict[str, float] = {}
        self.metrics: dict[str, float] = {}
        self.truncated = False
        self.bug: Bug | None = None  # env code raised (``ENV_CODE_ERRORS``) or broke the contract


def episode_trace(
    episode: Any, calls: Sequence[TokenCall], model: str, temperature: float
) -> Built:
    """The messages, branches, reward and errors of a verifiers ``episode``, checked
    against the token-in ``calls`` its client made (module docstring). Pure."""
    from schemas import Branch, Message, ToolCall, TraceError
    from schemas.arrays import f32, pack_f32, pack_i32, pack_mask

    out = Built()
    unclaimed = [c for c in calls if c.model == model]
    trainable = [t for t in episode.traces if t.agent.trainable]
    if not episode.ok:
        what = [e for t in episode.traces for e in t.errors] + list(episode.errors)
        first = what[0] if what else None
        if first is not None and first.type in ENV_CODE_ERRORS:
            out.bug = Bug(first.type, first.message, first.traceback or "")
        text = f"{first.type}: {first.message}" if first else "the episode did not finish"
        out.errors.append(TraceError(kind="harness_error", message=f"verifiers: {text}"[:2000]))
    elif len(trainable) != 1:  # the env breaks rlbus' contract: every episode would
        text = f"the episode has {len(trainable)} trainable agents; rlbus trains one"
        out.bug = Bug("ValueError", text)
        out.errors.append(TraceError(kind="harness_error", message=f"verifiers: {text}"))
    for trace in episode.traces:
        base = len(out.messages)
        index = {id(node): base + k for k, node in enumerate(trace.nodes)}
        paths: dict[int, list[int]] = {}  # node -> token sequence up to and including it
        for k, node in enumerate(trace.nodes):
            before = [] if node.parent is None else paths[node.parent]
            ids = list(node.token_ids)
            paths[k] = before + ids
            msg = node.message
            mask = [int(m) for m in node.mask] if node.mask else [0] * len(ids)
            logprobs = [0.0] * len(ids)
            fields: dict[str, Any] = {}
            if node.sampled and trace.agent.trainable:
                head = mask.index(1) if 1 in mask else len(ids)
                prompt, completion = before + ids[:head], ids[head:]
                call = _claim(unclaimed, prompt, completion)
                if call is None:
                    out.errors.append(TraceError(kind="render_error", message=(
                        f"verifiers' message {k} says it was sampled after a prompt of "
                        f"{len(prompt)} tokens, but no call of this rollout sampled it so")))  # fmt: skip
                else:
                    logprobs[head:] = f32(call.result.logprobs).tolist()
                    out.versions += call.result.versions()
                    out.truncated |= call.result.finish_reason == "length"
                    fields = {"temperature": temperature,
                              "policy_version": call.result.policy_version, "model": model,
                              "version_spans": call.result.version_spans,
                              "finish_reason": call.result.finish_reason}  # fmt: skip
            elif node.sampled:
                fields = {"model": f"{model}:{trace.agent.name}"}  # an agent that never trains
                mask = [0] * len(ids)
            tool_calls = [ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                          for c in getattr(msg, "tool_calls", None) or []]  # fmt: skip
            content = msg.content if isinstance(msg.content, str) else "".join(
                getattr(p, "text", "") for p in msg.content or [])  # fmt: skip
            out.messages.append(Message(
                id=base + k, role=msg.role, content=content or "",
                parent=None if node.parent is None else base + node.parent,
                token_ids=pack_i32(ids), sampled=pack_mask(mask), logprobs=pack_f32(logprobs),
                tool_calls=tool_calls, tool_call_id=getattr(msg, "tool_call_id", None),
                reasoning=getattr(msg, "reasoning_content", None), **fields))  # fmt: skip
        if trace.agent.trainable:
            for branch in trace.branches:
                if branch.trainable and any(n.sampled for n in branch.nodes):
                    out.branches.append(Branch(messages=[index[id(n)] for n in branch.nodes]))
    if trainable:
        trace = trainable[0]
        out.reward = float(trace.reward)
        out.rewards = {k: float(r.value) for k, r in trace.rewards.items() if r is not None}
        out.metrics = {k: float(v) for k, v in trace.metrics.items() if v is not None}
    return out


def _claim(calls: list[TokenCall], prompt: list[int], completion: list[int]) -> TokenCall | None:
    """The first unclaimed call that sampled ``completion`` after ``prompt`` (taken)."""
    from schemas.arrays import i32

    for k, call in enumerate(calls):
        if call.prompt == prompt and i32(call.result.completion_ids).tolist() == completion:
            return calls.pop(k)
    return None


def stop_of(condition: str | None) -> str:
    """The rlbus stop condition (``roles.lib.envs.stop``) of a verifiers stop condition:
    its context limits are ``prompt_too_long``, its turn, output and time budgets
    ``max_turns_reached``, its errors ``has_error``; anything else (``agent_completed``,
    ``user_closed``, a task's own ``@stop``) is the env ending it: ``schedule_exhausted``."""
    name = condition or ""
    if name in CONTEXT_LIMITS:
        return PROMPT_TOO_LONG
    if name in LENGTH_LIMITS or name.endswith("_timeout"):
        return MAX_TURNS_REACHED
    if name == "error" or name.endswith("_error"):
        return HAS_ERROR
    return SCHEDULE_EXHAUSTED


def _stop_of(episode: Any) -> str:
    """The rlbus stop condition of a finished episode: its trainable agent's."""
    return stop_of(next(t for t in episode.traces if t.agent.trainable).stop_condition)


def _state_record(episode: Any, columns: Sequence[str]) -> dict[str, Any]:
    """The env's state columns from the trainable agent's trace: ``stop_condition``, and
    its ``vf.State`` fields (JSON values; None for a field the state does not have)."""
    trace = next(t for t in episode.traces if t.agent.trainable)
    state = trace.state.model_dump(mode="json")
    return {c: trace.stop_condition if c == "stop_condition" else state.get(c) for c in columns}


__all__ = [
    "PREFIX",
    "VerifiersHarness",
    "episode_trace",
    "from_object",
    "load",
    "run_verifiers_rollout",
    "stop_of",
    "wrap",
]
