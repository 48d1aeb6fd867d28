"""What ``rlbus up`` checks before any role starts: one line naming the key, or nothing.

    check(cfg)   # raises configs.ConfigError("`model.path`: /nope does not exist ...")

A config that reaches the roles fails late and far from its cause: a missing
``model.path`` makes every role that loads the model crash-loop until the supervisor
gives up, and the reason is only in a role's log. So the launcher first checks the facts
it can check cheaply (no torch, no model load, no network), each problem naming its key:

- ``model.path`` and each ``orchestrator.models.<key>.path`` (of a model served by an
  inference role): a model directory (``config.json`` and weights), ``"tiny"``, or a hub
  id that is in the local Hugging Face cache when ``model.local_files_only`` is set;
- each ``orchestrator.train.env.<i>.id`` names an env, and the env builds with its args
  (what the env server does first), and its ``schedule`` and ``min_turns`` fit it: the
  schedule names its members, ``min_turns`` is within its turns (``max_turns``, else the
  env's own, and the schedule's), an env whose own code drives the conversation takes
  neither (``roles.lib.envs.registry.turn_problems``); the same for eval-only envs;
- each algorithm name (``orchestrator.algorithms``, ``orchestrator.warmup.algorithms``)
  names an algorithm: a built-in or an importable ``module:Class``;
- ``inference.backend = "vllm"`` has vllm installed; with the torch backend, every model
  it serves is one the engine runs (``roles.inference.capacity``: its ``model_type``) and
  the KV cache holds at least 4 sequences of ``inference.max_model_len`` (or the model's
  length) in ``inference.kv_cache_gb``, or on the CPU in its default 2 GB (on a GPU
  without ``kv_cache_gb`` the budget is the GPU's free memory, known only there; with
  ``device = "auto"`` a GPU is asked for only for a model other than the tiny one);
- ``model.renderer`` renders ``model.path``'s chat template exactly: on probe
  conversations (user turns, a system prompt, a tool call and its result) each next
  prompt built by extending the last one is the template's own rendering
  (``roles.lib.model.render.check_template``); this loads the tokenizer (transformers),
  for a model other than the tiny one;
- a warm start by the scripted teacher (``orchestrator.warmup.actor`` of kind
  ``teacher``) can read each train env's first prompt back into the messages it was
  rendered from (the teacher answers from them: ``roles.teacher``), through the policy's
  renderer;
- ``trainer.lora.target_modules`` names linear layers of the policy and
  ``modules_to_save`` modules of it (for a model other than the tiny one, built on the
  meta device: torch and transformers, no weights);
- ``trainer.device`` and ``inference.device``, when they name a CUDA device
  (``"cuda"``, ``"cuda:1"``), name one torch sees (``"auto"`` falls back to the CPU and
  is not checked); this imports torch, and only then;
- each ``monitor.sinks`` entry has its library installed, and online W&B has a key;
- ``bus.data_dir`` is writable and has ``MIN_FREE_BYTES`` free;
- each ``cpus.roles`` key names a role kind or process of the run, and its CPUs are ones
  this process may run on (``roles.up.cpu_plan``).

Checked elsewhere, and not repeated here: key typos, value ranges and cross-field
references (the config validators, at load); a ``-c`` name that is neither a file nor a
preset (``configs.load_config``); algorithm options and which algorithm may run on which
env (``roles.algorithm.checks.check_routing``, which ``up`` runs after this, once every
name here is known to resolve).

``rlbus up --dry-run`` runs these checks too, model path and disk included: a dry run
that prints a config ``rlbus up`` would then reject on this machine is a trap, and the
cost is that a config for another machine (whose model lives elsewhere) fails its dry
run here, with one line saying why. The devices are the exception (``check(cfg,
devices=False)``): resolving a GPU preset on a laptop is what a dry run is for, so it
prints the config and says on stderr that ``rlbus up`` would refuse it here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from configs import ConfigError, RunConfig
from configs.orchestrator import EnvConfig, EvalEnvConfig
from roles.lib.model import REPO_ID, serving_dtype

if TYPE_CHECKING:
    from roles.inference.capacity import ModelShape

TINY = "tiny"  # model.path of the tiny model, built under the run directory
MIN_FREE_BYTES = 1 << 30  # a run writes logs, checkpoints and its JetStream store
GIB = 1 << 30
_WEIGHTS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def check(cfg: RunConfig, *, devices: bool = True) -> None:
    """Raise ``ConfigError`` with every problem found, on one line; return if none.
    ``devices=False`` leaves out ``device_problems`` (``rlbus up --dry-run``)."""
    global _memo
    _memo = {}
    try:
        problems = _problems(cfg, devices)
    finally:
        _memo = None
    if problems:
        raise ConfigError("; ".join(problems))


# What one ``check`` built, for the checks that need the same thing (the policy's
# renderer, each train env); None outside ``check``: each call builds afresh.
_memo: dict[tuple[Any, ...], Any] | None = None


def _once(key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
    if _memo is None:
        return build()
    if key not in _memo:
        _memo[key] = build()
    return _memo[key]


def _problems(cfg: RunConfig, devices: bool) -> list[str]:
    return [
        *model_problems(cfg),
        *env_problems(cfg),
        *eval_env_problems(cfg),
        *algorithm_problems(cfg),
        *backend_problems(cfg),
        *engine_problems(cfg),
        *lora_problems(cfg),
        *template_problems(cfg),
        *teacher_problems(cfg),
        *(device_problems(cfg) if devices else []),
        *sink_problems(cfg),
        *data_dir_problems(cfg),
        *cpu_problems(cfg),
    ]


# -- models ---------------------------------------------------------------------------------


def model_paths(cfg: RunConfig) -> Iterator[tuple[str, str]]:
    """(key, path) of every model an inference or trainer role loads from a path.

    A teacher (``kind = "teacher"``) is the scripted teacher role and loads no weights; an
    endpoint without ``path`` serves the base weights at ``model.path``."""
    yield "model.path", cfg.model.path
    for key, endpoint in cfg.orchestrator.models.items():
        if endpoint.kind != "teacher" and endpoint.path is not None:
            yield f"orchestrator.models.{key}.path", endpoint.path


def model_problems(cfg: RunConfig) -> list[str]:
    local_only = cfg.model.local_files_only
    found = ((key, _model_problem(path, local_only)) for key, path in model_paths(cfg))
    return [f"`{key}`: {problem}" for key, problem in found if problem]


def _model_problem(path: str, local_files_only: bool) -> str | None:
    """Why ``path`` cannot be loaded the way the roles load it, or None."""
    if path == TINY:
        return None
    local = Path(path).expanduser()
    if local.exists():
        return _model_dir_problem(local)
    if not REPO_ID.match(path):
        return f"{path} does not exist (give a model directory, a cached hub id, or {TINY!r})"
    if local_files_only and not _in_hub_cache(path):
        return (
            f"{path!r} is neither a local directory nor in the Hugging Face cache "
            "(`model.local_files_only` = true, so nothing is downloaded)"
        )
    return None


def _model_dir_problem(path: Path) -> str | None:
    if not path.is_dir():
        return f"{path} is a file, not a model directory"
    if not (path / "config.json").is_file():
        return f"{path} is not a model directory (no config.json)"
    if not any(next(path.glob(pattern), None) for pattern in _WEIGHTS):
        return f"{path} has no weights (no *.safetensors or *.bin)"
    return None


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


# -- envs and algorithms ------------------------------------------------------------------


def env_problems(cfg: RunConfig) -> list[str]:
    """Each train env built with its args, as its env server will build it first, and its
    rollout filters built from their options."""
    from roles.lib.envs.filters import filter_problems

    envs = cfg.orchestrator.train.env
    found = (_env_problem(cfg, f"orchestrator.train.env.{i}", e.id, e.args)
             for i, e in enumerate(envs))  # fmt: skip
    turns = (_turn_problems(f"orchestrator.train.env.{i}", e) for i, e in enumerate(envs))
    return [p for p in found if p] + [p for ps in turns for p in ps] + filter_problems(envs)


def _turn_problems(where: str, entry: EnvConfig | EvalEnvConfig) -> list[str]:
    """The entry's ``schedule`` and ``min_turns`` against its env (built with its args;
    one that does not build is ``_env_problem``'s to report)."""
    from roles.lib.envs.registry import turn_options, turn_problems

    options = turn_options(entry)
    if not options:
        return []
    try:
        env = _built_env(entry.id, entry.args)
    except Exception:  # noqa: BLE001 - reported by _env_problem
        return []
    return [f"`{where}.{key}`: {why}" for key, why in turn_problems(env, **options)]


def _env_problem(
    cfg: RunConfig, where: str, env_id: str, args: dict[str, Any] | None
) -> str | None:
    """Why the env at config key ``where`` does not build with ``args`` (or cannot run on
    the run's model), or None."""
    from roles.lib.envs.registry import UnknownEnv
    from roles.lib.envs.vf import VerifiersHarness

    try:
        env = _built_env(env_id, args)
    except UnknownEnv as e:
        return f"`{where}.id`: {_one_line(e)}"
    except ValueError as e:  # make_env's own: args the env's constructor does not take
        return f"`{where}.args`: {_one_line(e)}"
    except Exception as e:  # noqa: BLE001 - user env code: any failure is a config problem
        return f"`{where}`: env {env_id!r} fails to build: {type(e).__name__}: {_one_line(e)}"
    char = cfg.model.renderer == "rlbus" or (
        cfg.model.path == TINY and cfg.model.tiny.arch == "char"
    )
    if isinstance(env.harness, VerifiersHarness) and char:
        return (f"`{where}.id`: {env_id!r} is a verifiers env: its client renders prompts with "
                "the `renderers` package, which has no renderer for the character model; "
                "set model.tiny.arch = qwen3|llama or model.path")  # fmt: skip
    return None


def _built_env(env_id: str, args: dict[str, Any] | None) -> Any:
    """``make_env(env_id, args)``, built once per ``check`` (two checks use it)."""
    from roles.lib.envs.registry import make_env

    key = ("env", env_id, json.dumps(args or {}, sort_keys=True, default=repr))
    return _once(key, lambda: make_env(env_id, dict(args or {})))


def algorithm_names(cfg: RunConfig) -> Iterator[tuple[str, str]]:
    """(key, registered name) of every algorithm worker ``rlbus up`` starts."""
    o = cfg.orchestrator
    for i, a in enumerate(o.algorithms):
        name = a.name or a.id
        yield (f"orchestrator.algorithms.{i}.{'id' if name == a.id else 'name'}", name)
    if o.warmup.steps > 0:
        ids = {a.id for a in o.algorithms}
        for name in o.warmup.algorithms:
            if name not in ids:
                yield "orchestrator.warmup.algorithms", name


def algorithm_problems(cfg: RunConfig) -> list[str]:
    """Names that resolve to no algorithm (options are ``check_routing``'s to check)."""
    from roles.algorithm.registry import UnknownAlgorithm, resolve

    problems = []
    for key, name in algorithm_names(cfg):
        try:
            resolve(name)
        except UnknownAlgorithm as e:
            problems.append(f"`{key}`: {_one_line(e)}")
    return problems


def backend_problems(cfg: RunConfig) -> list[str]:
    if cfg.inference.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        return ['`inference.backend` = "vllm", but vllm is not installed (pip install rlbus[vllm])']
    return []


def engine_problems(cfg: RunConfig) -> list[str]:
    """The torch engine: each served model's architecture, and the KV budget (docstring)."""
    from roles.inference import capacity

    inf = cfg.inference
    if inf.backend != "torch":
        return []
    problems = []
    for key, path in model_paths(cfg):
        shape = _model_shape(cfg, path)
        if shape is None:
            continue  # (a directory without a readable config: model_problems says so)
        if (why := shape.unsupported()) is not None:
            problems.append(f"`{key}`: {why}")
            continue
        device = inf.device
        if device == "auto":
            device = "cpu" if path == TINY or not _gpu_seen() else "cuda"
        if inf.kv_cache_gb is None and capacity.on_cuda(device):
            continue
        budget = int(inf.kv_cache_gb * GIB) if inf.kv_cache_gb else capacity.CPU_KV_BYTES
        dtype = serving_dtype(cfg.model.dtype, device, inf.dtype)
        max_len = capacity.round_up(
            min(shape.max_positions, inf.max_model_len or shape.max_positions)
        )
        per_token = shape.kv_bytes_per_token(capacity.DTYPE_BYTES.get(dtype, 4))
        try:
            capacity.plan_slots(inf.max_batch_size, max_len, per_token, budget)
        except capacity.KVCacheTooSmall as e:
            problems.append(f"`inference.kv_cache_gb` ({key}): {e}")
    return problems


# The tiny model's modules with weights, by the last part of their name (its families
# are Llama-shaped; Qwen3 adds a norm on queries and keys): preflight builds no model.
_TINY_MODULES = {"embed_tokens", "lm_head", "input_layernorm", "post_attention_layernorm", "norm"}


def lora_problems(cfg: RunConfig) -> list[str]:
    """``trainer.lora``'s targets are linear layers of the policy and its modules to save
    modules of it (the tiny model's by its families' names; another model is built on
    the meta device from its config: torch and transformers, no weights)."""
    lo = cfg.trainer.lora
    if lo is None:
        return []
    from configs.models import LORA_TARGETS, lora_targets_problem

    if cfg.model.path == TINY:
        linear = set(LORA_TARGETS)  # (its lm_head is tied to its embeddings)
        modules = (
            linear
            | _TINY_MODULES
            | ({"q_norm", "k_norm"} if cfg.model.tiny.arch == "qwen3" else set())
        )
    else:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from roles.lib.model.lora import linear_layers, module_names

        try:
            config = AutoConfig.from_pretrained(cfg.model.path, local_files_only=True)
        except (OSError, ValueError):
            return []  # (model_problems names an unreadable model)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        linear, modules = linear_layers(model), module_names(model)
    problem = lora_targets_problem(lo, linear, modules)
    return [] if problem is None else [problem]


def _policy_renderer(cfg: RunConfig) -> tuple[Any, list[str]]:
    """The renderer the run's roles will build for the policy (``model.renderer`` over
    ``model.path``'s tokenizer), or None and why not (nothing when ``model_problems``
    says it already)."""
    m = cfg.model
    if _model_problem(m.path, m.local_files_only):
        return None, []  # (model_problems says why)
    args = (m.path, m.tiny.arch, m.tiny.vocab_size, m.renderer, m.local_files_only)
    renderer, problems = _once(("renderer", *args), lambda: _renderer_of(*args))
    return renderer, list(problems)


def _renderer_of(
    path: str, arch: str, vocab_size: int | None, name: str, local_files_only: bool
) -> tuple[Any, tuple[str, ...]]:
    """``_policy_renderer``'s work (once per ``check``: two checks use it)."""
    from roles.lib.model.families import FAMILIES, SIZES, train_tokenizer
    from roles.lib.model.loading import load_tokenizer
    from roles.lib.model.render import make_renderer
    from roles.lib.model.tokenizer import build_tokenizer

    if path == TINY:
        vocab = vocab_size or SIZES["tiny"]["vocab_size"]
        tokenizer = build_tokenizer() if arch == "char" else train_tokenizer(FAMILIES[arch], vocab)
    else:
        try:
            tokenizer = load_tokenizer(path, local_files_only=local_files_only)
        except Exception as e:  # noqa: BLE001 - whatever transformers says, on one line
            return None, (f"`model.path`: no tokenizer loads from {path}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}",)  # fmt: skip
    if getattr(tokenizer, "chat_template", None) is None:
        return None, (f"`model.path`: {path} has no chat template (tokenizer_config.json)",)
    try:
        return make_renderer(tokenizer, name), ()
    except (ValueError, AssertionError) as e:
        return None, (f"`model.renderer` ({name!r}): {e}",)


def template_problems(cfg: RunConfig) -> list[str]:
    """The policy's chat template, rendered by ``model.renderer`` (docstring)."""
    path = cfg.model.path
    if path == TINY and cfg.model.renderer == "auto":
        return []  # a template built here, with its renderer (tests/unit/test_families.py)
    from roles.lib.model.render import check_template

    renderer, problems = _policy_renderer(cfg)
    if renderer is None:
        return problems
    why = check_template(renderer)
    if why is None:
        return []
    name = getattr(renderer, "name", "rlbus")
    return [
        f"`model.renderer` ({cfg.model.renderer!r} = {name!r}) cannot render the chat "
        f"template of {path} exactly: {why}; set `model.renderer` to its family's renderer"
    ]


def teacher_problems(cfg: RunConfig) -> list[str]:
    """A warm start by the scripted teacher (docstring): it reads each request's
    conversation back from the prompt tokens, so the policy's renderer must give back
    the messages it rendered, for each train env's first prompt."""
    o = cfg.orchestrator
    actor = o.models.get(o.warmup.actor)
    if o.warmup.steps == 0 or actor is None or actor.kind != "teacher":
        return []
    renderer, _ = _policy_renderer(cfg)  # (template_problems reports why there is none)
    if renderer is None:
        return []
    for i, entry in enumerate(o.train.env):
        try:
            env = _built_env(entry.id, entry.args)
            messages = env.initial_messages(env.task("train", 0))
            ids = renderer.render_prompt(messages, list(env.tools) or None)
        except Exception:  # noqa: BLE001 - env_problems / template_problems say why
            continue
        try:
            read = renderer.read_conversation(ids)
            why = None if _said(read) == _said(messages) else f"read {_said(read)[:3]}"
        except Exception as e:  # noqa: BLE001 - any failure to read back is the problem
            why = f"{type(e).__name__}: {_one_line(e)}"
        if why is not None:
            name = getattr(renderer, "name", "rlbus")
            return [
                f"`orchestrator.warmup`: the scripted teacher (`orchestrator.models."
                f"{o.warmup.actor}`) cannot read back the prompts of "
                f"`orchestrator.train.env.{i}` ({entry.id!r}) rendered by renderer {name!r} "
                f"for {cfg.model.path} ({why}); set `orchestrator.warmup.steps = 0`, or "
                "`model.renderer` to the model's family (qwen3, llama-3)"
            ]
    return []


def _said(messages: Any) -> list[tuple[str, str]]:
    """(role, content) of each message: what the teacher needs to have read back."""
    return [(m.get("role", ""), (m.get("content") or "").strip()) for m in messages]


def _model_shape(cfg: RunConfig, path: str) -> ModelShape | None:
    """The shape of the model at ``path`` (the tiny one: from ``model.tiny``)."""
    from roles.inference.capacity import ModelShape

    if path == TINY:
        t = cfg.model.tiny
        from roles.lib.model.families import kv_heads as family_kv_heads

        kv_heads = t.num_heads if t.arch == "char" else family_kv_heads(t.num_heads)
        return ModelShape("llama" if t.arch == "char" else t.arch, t.num_layers, kv_heads,
                          t.hidden_size // t.num_heads, t.max_position_embeddings)  # fmt: skip
    config = Path(path).expanduser() / "config.json"
    if not config.is_file() and REPO_ID.match(path):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json")
        config = Path(cached) if isinstance(cached, str) else config
    try:
        return ModelShape.of(json.loads(config.read_text()))
    except (OSError, ValueError):
        return None


def _gpu_seen() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def device_problems(cfg: RunConfig) -> list[str]:
    """A ``trainer.device`` / ``inference.device`` naming a CUDA device torch cannot see.

    Without this a CPU-only torch fails inside the trainer and the inference role, which
    crash-loop until the supervisor gives up. vLLM ignores ``inference.device``."""
    named = [("trainer.device", cfg.trainer.device)]
    if cfg.inference.backend == "torch":
        named.append(("inference.device", cfg.inference.device))
    cuda = [(key, device) for key, device in named if device.startswith("cuda")]
    ranks_on_auto = cfg.trainer.device == "auto" and cfg.trainer.world_size > 1
    if not cuda and not ranks_on_auto:
        return []  # no torch import for CPU and single-process "auto" configs
    import torch

    if ranks_on_auto and torch.cuda.is_available():  # "auto" means CUDA here
        cuda.insert(0, ("trainer.device", "cuda"))

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    problems = []
    for key, device in cuda:
        try:
            index = torch.device(device).index or 0
        except RuntimeError as e:  # "cuda:x" and the like
            problems.append(f'`{key}` = "{device}": {_one_line(e)}')
            continue
        ranks = cfg.trainer.world_size if key == "trainer.device" else 1
        if count == 0:
            why = f"torch sees no CUDA GPU (torch {torch.__version__})"
        elif index >= count:
            why = f"torch sees {count} CUDA GPU(s), so no {device}"
        elif index + ranks > count:
            why = f"`trainer.world_size` = {ranks} needs a GPU per rank from {device}; torch sees {count}"
        else:
            continue
        problems.append(f'`{key}` = "{device}", but {why}')
    return problems


def sink_problems(cfg: RunConfig) -> list[str]:
    from roles.monitor.sinks import missing_library, wandb_online_problem

    problems = [f"`monitor.sinks`: {why}" for s in cfg.monitor.sinks if (why := missing_library(s))]
    if "wandb" in cfg.monitor.sinks and (why := wandb_online_problem(cfg.monitor)):
        problems.append(f"`monitor.wandb.mode`: {why}")
    return problems


# -- the data directory -------------------------------------------------------------------


def data_dir_problems(cfg: RunConfig, min_free: int = MIN_FREE_BYTES) -> list[str]:
    """The data directory (created by ``up`` if missing) can be written and has room."""
    data_dir = Path(cfg.bus.data_dir).expanduser()
    where = f"`bus.data_dir` ({data_dir})"
    if data_dir.exists() and not data_dir.is_dir():
        return [f"{where}: exists and is not a directory"]
    base = _nearest_existing(data_dir)
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        return [f"{where}: {base} is not writable"]
    free = shutil.disk_usage(base).free
    if free < min_free:
        need = f"rlbus up needs at least {min_free / GIB:g} GiB"
        return [f"{where}: {free / GIB:.2f} GiB free, {need}"]
    return []


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest existing ancestor (what ``mkdir -p`` would write into)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _one_line(e: BaseException) -> str:
    """An exception's message with its line breaks folded (an ImportError's can have some)."""
    return " ".join(str(e).split()) or type(e).__name__


def cpu_problems(cfg: RunConfig) -> list[str]:
    """``cpus.roles`` keys that name no role of the run, or CPUs this machine lacks."""
    from roles.up.cpu_plan import available_cpus, plan_problems
    from roles.up.launcher import process_names

    return plan_problems(cfg, process_names(cfg), available_cpus())


def eval_env_problems(cfg: RunConfig) -> list[str]:
    """Each eval-only env (``orchestrator.eval.env`` entries naming no train env) built
    with its args, as its env server will build it first; a train env's entry is built
    with the args its eval requests carry when it sets its own."""
    o = cfg.orchestrator
    problems = []
    for i, entry in enumerate(o.eval.env):
        if o.env(entry.id) is not None and entry.args is None:
            continue  # built by env_problems, as its train entry
        if why := _env_problem(cfg, f"orchestrator.eval.env.{i}", entry.id, entry.args):
            problems.append(why)
        problems += _turn_problems(f"orchestrator.eval.env.{i}", entry)
    return problems
