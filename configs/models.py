"""The run config: one pydantic model per TOML section, `RunConfig` at the top.

Every model forbids unknown keys, so a typo fails at start naming the key instead of
silently running with a default. Defaults here are the library defaults; the presets
under `configs/presets/` spell out what `just up` actually runs. Load configs with
`configs.load_config` (files, presets, overrides, deprecated spellings); this module
only declares shapes and rules. It imports nothing heavy: the CLI and every role
import it before deciding whether torch is needed.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from bus.settings import BusSettings
from configs.orchestrator import OrchestratorConfig, orchestrator_problems, pool_bounds

# Run ids become NATS subject tokens and stream names (`RL_<run>`), where dots,
# spaces and wildcards are not allowed.
RUN_ID_PATTERN = r"^[A-Za-z0-9_-]+$"
RunId = Annotated[str, StringConstraints(pattern=RUN_ID_PATTERN)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


_BUS = BusSettings()


class BusConfig(_Section):
    """Connection to NATS JetStream and the delivery guarantees of every consumer."""

    url: str | None = None  # None = start an embedded nats-server under the run directory
    data_dir: str = "runs"  # root of run directories (JetStream store, weights, logs)
    # The defaults are bus.settings.BusSettings's (one place; what each means is there).
    # Bodies larger than this go to the object store; NATS max_payload defaults to 1 MB.
    offload_threshold_bytes: int = Field(default=_BUS.offload_threshold_bytes, gt=0)
    max_deliver: int = Field(default=_BUS.max_deliver, ge=1)  # then a message is dead-lettered
    # Seconds a consumer may hold a message unanswered before the server redelivers it:
    # how soon work held by a dead consumer comes back. Live consumers keep every message
    # they hold alive (`in_progress` every ack_wait/3), so a slow handler is not affected.
    ack_wait_s: float = Field(default=_BUS.ack_wait_s, gt=0)
    nak_delay_s: float = Field(default=_BUS.nak_delay_s, ge=0)
    # How long the stream remembers Nats-Msg-Id values to drop duplicate publishes.
    duplicate_window_s: float = Field(default=_BUS.duplicate_window_s, gt=0)
    heartbeat_interval_s: float = Field(default=2.0, gt=0)
    # A role whose server stays unreachable this long exits with a one-line error.
    server_lost_s: float = Field(default=_BUS.server_lost_s, gt=0)
    # Nodes of the embedded JetStream cluster `rlbus up` starts on loopback (1: one server).
    cluster: int = Field(default=1, ge=1, le=9)
    # Copies of the run's stream, object store and role registry. None: 1 on one server,
    # the node count on a cluster (`rlbus up --cluster 3`: 3, any one node may die).
    replicas: int | None = Field(default=None, ge=1, le=5)
    # TLS for the embedded server(s) and every client: the server's certificate and key,
    # and the CA clients (and cluster peers) check it against. All three or none.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    # The embedded server's HTTP monitoring port (on 127.0.0.1). None: off.
    monitor_port: int | None = Field(default=None, ge=1, le=65535)
    # Role processes the launcher starts cannot read the launcher's credentials, the
    # server's configuration, another run's credentials or the launcher's memory (Linux
    # Landlock, capabilities dropped: bus.sandbox). false: they run unconfined, as every
    # process of one OS user does (e.g. a GPU transport that needs ptrace between roles).
    sandbox: bool = True

    @model_validator(mode="after")
    def _tls_complete(self) -> BusConfig:
        given = [k for k in ("tls_cert", "tls_key", "tls_ca") if getattr(self, k)]
        if given and len(given) != 3:
            missing = sorted({"tls_cert", "tls_key", "tls_ca"} - set(given))
            raise ValueError(f"bus.tls_* needs all three; missing: {', '.join(missing)}")
        if self.url is None and (self.replicas or 1) > self.cluster:
            raise ValueError(
                f"bus.replicas = {self.replicas} needs as many nodes: bus.cluster = {self.cluster} "
                f"(rlbus up --cluster {self.replicas})"
            )
        return self

    def resolved_replicas(self) -> int:
        """``replicas``, or its default: 1 on one server, up to 3 on a cluster."""
        return self.replicas or min(3, self.cluster)


class TinyModelConfig(_Section):
    """Shape of the tiny model built locally when `model.path = "tiny"`."""

    # "char": Llama-style over the character tokenizer; "qwen3" / "llama": the family's
    # architecture with a BPE tokenizer and chat template (roles.lib.model.families).
    arch: Literal["char", "qwen3", "llama"] = "char"
    # BPE vocabulary of a family arch (None: 768); the char tokenizer's is its alphabet.
    vocab_size: int | None = Field(default=None, ge=300)
    hidden_size: int = Field(default=128, ge=1)
    num_layers: int = Field(default=2, ge=1)
    num_heads: int = Field(default=4, ge=1)
    intermediate_size: int = Field(default=256, ge=1)
    max_position_embeddings: int = Field(default=256, ge=1)
    init_seed: int = 0

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"`model.tiny.hidden_size` ({self.hidden_size}) must be divisible by "
                f"`model.tiny.num_heads` ({self.num_heads})"
            )
        if self.arch == "char" and self.vocab_size is not None:
            raise ValueError("`model.tiny.vocab_size` is for arch qwen3 or llama (char: fixed)")
        if self.arch != "char" and self.num_heads % 2:
            raise ValueError(f"`model.tiny.num_heads` ({self.num_heads}) must be even for "
                             f"arch {self.arch!r} (two query heads per key/value head)")  # fmt: skip
        return self


class ModelConfig(_Section):
    """The policy model: where its initial weights come from and in which dtype."""

    path: str = "tiny"  # "tiny" = the locally built tiny model; else a local HF dir or hub id
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    local_files_only: bool = True  # never reach the network for weights or tokenizer
    # Chat rendering (roles.lib.model.render): "auto" picks the family's renderer from the
    # tokenizer's special tokens (Qwen3, Llama 3), else "rlbus"; or any renderer name of
    # the `renderers` package ("qwen3", "llama-3", "glm-4.5", ...). Checked by `rlbus up`
    # on probe conversations before any role starts.
    renderer: str = "auto"


class InferenceConfig(_Section):
    """Inference servers: one queue group per model; the policy's `replicas` processes
    make a pool, elastic when `max_replicas` > `min_replicas` (docs/running.md#env-pools)."""

    backend: Literal["torch", "vllm"] = "torch"
    replicas: int = Field(default=1, ge=1)
    # The policy's pool bounds; None: `replicas` (a static pool). `rlbus up` adds a
    # replica while the replicas' mean busy share (their `busy_frac` metric) stays at or
    # above `scale_up_busy` for `scale_up_after_s`, and retires one while the others
    # could carry the load at half that share for `scale_down_idle_s`.
    min_replicas: int | None = Field(default=None, ge=1)
    max_replicas: int | None = Field(default=None, ge=1)
    scale_up_busy: float = Field(default=0.9, gt=0, le=1)
    # Longer than the env pool's: a replica reports its busy share every 10 s.
    scale_up_after_s: float = Field(default=30.0, ge=0)
    scale_down_idle_s: float = Field(default=120.0, ge=0)
    device: str = "auto"  # "auto" = cuda when available, else cpu
    # Dtype the weights are served in: "auto" = bfloat16 on CUDA (float16 if model.dtype
    # is float16), model.dtype elsewhere; float32 on CUDA trades speed for less mismatch.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Rows decoded at once (the torch engine's KV slots; vLLM's max_num_seqs is its own).
    max_batch_size: int = Field(default=64, ge=1)
    # How long the first request to reach an idle engine waits for others to start with it.
    batch_window_ms: float = Field(default=5.0, ge=0)
    # Longest prompt + completion served (a KV slot's length); None: the model's
    # max_position_embeddings. Longer prompts are refused as context_too_long.
    max_model_len: int | None = Field(default=None, ge=2)
    # Torch backend: GB of KV cache (max_batch_size slots of max_model_len tokens, fewer
    # if they do not fit); None: on CUDA what gpu_memory_fraction leaves after the
    # weights and a 10% reserve, on the CPU 2 GB. Too small for one slot: refused at start.
    kv_cache_gb: float | None = Field(default=None, gt=0)
    # Torch backend on CUDA: replay each decode step as a captured CUDA graph (false: eager).
    cuda_graphs: bool = True
    # With cuda_graphs: step shapes captured when the replica starts, shortest lengths first
    # (the gpu preset's 80 are all it has: a few seconds), so no request or weights swap
    # waits for a capture mid-run; the rest on first use (0: every shape on first use).
    graphs_at_start: int = Field(default=96, ge=0)
    # How a policy replica swaps in a new weights version (torch backend): "in_flight"
    # between two decode steps, live rows carrying on under the new weights (each token
    # span keeps the version that sampled it: GenerateResult.version_spans); "drain":
    # admissions stop and the live rows finish first, so every completion comes from one
    # version (exact, slower). vLLM always drains.
    swap: Literal["in_flight", "drain"] = "in_flight"
    request_timeout_s: float = Field(default=60.0, gt=0)
    # Seconds one attempt of a request waits before it is sent again (the queue group hands
    # it to a live replica: one that died holding it costs this, not request_timeout_s).
    attempt_timeout_s: float = Field(default=20.0, gt=0)
    # A replica that takes a request sends a sign of life every silence_s / 3 while it
    # works on it; one silent this long is taken as gone and the request is sent again
    # at once (a replica killed, a server restarted: seconds, not attempt_timeout_s).
    silence_s: float = Field(default=2.0, gt=0)
    # Share of the GPU's memory inference may take (CUDA only), so the trainer fits beside
    # it on one GPU: the torch backend caps its allocator, vLLM gets it as
    # `gpu_memory_utilization`.
    gpu_memory_fraction: float = Field(default=0.45, gt=0, le=1)
    # Eval pinning: a policy replica holds back a weights swap while requests pinned to the
    # version it serves (an eval round's) run, and `eval_pin_grace_s` after the last one;
    # never longer than `eval_pin_max_s` (also its wait for a newer pinned version; keep
    # it below `attempt_timeout_s`, or a waiting request is sent again meanwhile).
    eval_pin_grace_s: float = Field(default=0.5, ge=0)
    eval_pin_max_s: float = Field(default=15.0, ge=0)
    # A version the orchestrator evaluates is also held until that eval's first pinned
    # request comes (its requests may queue behind train groups), at most this long.
    eval_pin_expect_s: float = Field(default=3.0, ge=0)

    @property
    def pool(self) -> tuple[int, int]:
        """(min, max) policy replicas; equal for a static pool."""
        return pool_bounds(self.replicas, self.min_replicas, self.max_replicas)

    @model_validator(mode="after")
    def _attempt_within_request(self) -> InferenceConfig:
        if self.attempt_timeout_s > self.request_timeout_s:
            raise ValueError(
                f"`inference.attempt_timeout_s` ({self.attempt_timeout_s:g}) must not exceed "
                f"`inference.request_timeout_s` ({self.request_timeout_s:g})"
            )
        if self.silence_s >= self.attempt_timeout_s:
            raise ValueError(
                f"`inference.silence_s` ({self.silence_s:g}) must be below "
                f"`inference.attempt_timeout_s` ({self.attempt_timeout_s:g})"
            )
        if self.eval_pin_max_s >= self.attempt_timeout_s:
            raise ValueError(
                f"`inference.eval_pin_max_s` ({self.eval_pin_max_s:g}) must be below "
                f"`inference.attempt_timeout_s` ({self.attempt_timeout_s:g}): a request "
                "waiting for a pinned version would be sent again meanwhile"
            )
        low, high = self.pool
        if not low <= self.replicas <= high:
            raise ValueError(
                f"`inference.replicas` = {self.replicas} must lie within "
                f"`inference.min_replicas`..`inference.max_replicas` ({low}..{high})"
            )
        return self


class EnvServerConfig(_Section):
    """Env server processes (`rlbus role env`): each train env's pool of replicas
    (`orchestrator.train.env[].replicas`), and when `rlbus up` resizes an elastic one."""

    # Groups one env server process rolls out at once (its task consumer's concurrency).
    # `orchestrator.max_groups_in_flight` bounds how many groups are requested in all.
    groups_in_flight: int = Field(default=8, ge=1)
    # An elastic env pool (max_replicas > min_replicas) gets a replica while the groups
    # waiting on its consumer (not yet taken by a replica) stay at or above this many per
    # replica for `scale_up_after_s`, and retires one after `scale_down_idle_s` with
    # nothing waiting and nothing in flight. The launcher reads every pool's load (env
    # backlogs, inference busy shares) every `scale_check_s`.
    scale_up_backlog: float = Field(default=4.0, gt=0)
    scale_up_after_s: float = Field(default=10.0, ge=0)
    scale_down_idle_s: float = Field(default=30.0, ge=0)
    scale_check_s: float = Field(default=2.0, gt=0)


class LossConfig(_Section):
    """Policy-gradient loss with an asymmetric trust region on the importance ratio."""

    # A token is masked when its ratio < 1 - trust_region_low or > 1 + trust_region_high.
    trust_region_low: float = Field(default=0.2, gt=0)
    trust_region_high: float = Field(default=0.28, gt=0)
    kl_coef: float = Field(default=0.0, ge=0)  # k3 KL to the inference policy on rl tokens; 0 = off
    normalize: Literal["tokens", "sequences"] = "tokens"


# The projections LoRA adapts by default: every linear layer of a Llama/Qwen-style block.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(_Section):
    """Low-rank adapters (``[trainer.lora]``; the peft library): only the adapters train,
    checkpoint and travel to inference, which serves the base weights plus
    ``alpha / rank x B @ A`` (roles.lib.model.lora)."""

    rank: int = Field(default=8, ge=1)
    alpha: int = Field(default=16, gt=0)  # the update is scaled by alpha / rank
    dropout: float = Field(default=0.0, ge=0, lt=1)  # on the adapter's input, in training
    # Module names (the last part of their path) that get adapters.
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)
    # Modules trained whole beside the adapters, and published whole (e.g. "embed_tokens":
    # where the output layer is tied to the embeddings, as in the tiny model, the output
    # distribution moves only through them; the tie is kept).
    modules_to_save: list[str] = []


def lora_targets_problem(lora: LoraConfig, linear: set[str], modules: set[str]) -> str | None:
    """Why ``trainer.lora`` does not fit a model whose linear layers are ``linear`` and
    whose modules with parameters are ``modules`` (last part of their path), or None:
    each target must be a linear layer, each module to save a module, and none both (a
    typo would train less than asked). The trainer and ``rlbus up``'s preflight ask."""
    if unmatched := sorted(set(lora.target_modules) - linear):
        return (f"`trainer.lora.target_modules`: {unmatched} matches no linear layer of the "
                f"model (its linear layers: {sorted(linear)})")  # fmt: skip
    if unmatched := sorted(set(lora.modules_to_save) - modules):
        return (f"`trainer.lora.modules_to_save`: {unmatched} matches no module of the model "
                f"(its modules with weights: {sorted(modules)})")  # fmt: skip
    if both := sorted(set(lora.modules_to_save) & set(lora.target_modules)):
        return f"`trainer.lora`: {both} is in both `target_modules` and `modules_to_save`"
    return None


class TrainerConfig(_Section):
    """Optimizer, schedule, packing and checkpoints of the trainer role."""

    lr: float = Field(default=3e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(default=0.0, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)  # max global grad norm
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)  # linear lr warmup steps
    seq_len: int = Field(default=2048, ge=1)  # tokens per packed micro-batch
    micro_batch_size: int | None = Field(default=None, ge=1)  # None = pack by seq_len only
    # Samples that share a prompt (a GRPO group) run it once per micro-batch: its keys and
    # values feed every sample's completion (roles.trainer.packing); one rank, no compile.
    shared_prefix: bool = True
    device: str = "auto"
    checkpoint_interval: int = Field(default=10, ge=0)  # steps between checkpoints; 0 = off
    # Newest checkpoints kept in <run dir>/checkpoints (older ones are deleted as a new one
    # is written); 0 = keep every checkpoint.
    keep_checkpoints: int = Field(default=2, ge=0)
    # Besides those, a checkpoint whose step is a multiple of this is kept for good; 0 =
    # none. Checkpoints are written every `checkpoint_interval` steps and at a graceful
    # stop, so the steps kept are those that are multiples of both (100 and 10: 100, 200).
    checkpoint_keep_every: int = Field(default=100, ge=0)
    # Newest stored weights versions kept in the run's object store (older ones are
    # deleted once a newer one is announced; the initial weights and a policy snapshot's
    # version always stay); 0 = keep all.
    keep_weights: int = Field(default=4, ge=0)
    # Ranks (processes joined by torch.distributed, FSDP2-sharded; gloo on CPU, NCCL on
    # CUDA, one GPU per rank) that train as one role; checkpoints resume on as many ranks.
    world_size: int = Field(default=1, ge=1)
    # Seconds a rank waits in a collective before the group gives up (a dead or hung rank).
    collective_timeout_s: float = Field(default=120.0, gt=0)
    # "auto": bf16 autocast over fp32 master weights on CUDA, plain fp32 on the CPU.
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # torch.compile each transformer block (one compiled graph serves every block, with
    # dynamic batch and sequence sizes): fused kernels and fewer launches. The first
    # steps pay the compile (tens of seconds); on the CPU it needs a C++ compiler.
    compile: bool = False
    # The trainer device's dense peak TFLOP/s, for the `mfu` metric (model FLOPs per
    # second, `flops_per_s`, over it); None: known GPUs by name (H100/H200 989, A100 312),
    # no `mfu` on the CPU.
    peak_tflops: float | None = Field(default=None, gt=0)
    # Where published weights go: "auto" = the object store up to 200 MB, else a file in
    # `weights_dir`; "object"; "path" (a file in `weights_dir`, for hosts sharing it);
    # "shm" (a file in /dev/shm: trainer and inference on one host, no disk round trip);
    # "ipc" (trainer and inference on one device: a ring of serving-dtype buffers shared
    # through CUDA IPC, or /dev/shm on the CPU; each version is a device-to-device copy,
    # roles.lib.model.shared_weights), every `store_weights_every`-th version, a policy
    # snapshot's and the last also stored as "auto" does (RunConfig.stores_weights: the
    # fallback of a replica that cannot read the device copy, one that restarts, an
    # archive); the every-Nth while the next step trains, named by `weights.stored`; "broadcast"
    # (replicas on other GPUs or hosts: each version sent over a torch.distributed pair
    # group, gloo on the CPU, NCCL on CUDA, from a rendezvous on `broadcast_host`;
    # roles.lib.model.broadcast), stored the same way.
    weights_via: Literal["auto", "object", "path", "shm", "ipc", "broadcast"] = "auto"
    store_weights_every: int = Field(default=10, ge=1)  # with "ipc" or "broadcast" only
    # The address replicas reach the trainer's rendezvous at (weights_via = "broadcast").
    broadcast_host: str = "127.0.0.1"
    weights_dir: str | None = None  # None = <run dir>/weights
    loss: LossConfig = Field(default_factory=LossConfig)
    # None: full fine-tuning; a table: LoRA adapters only (see LoraConfig).
    lora: LoraConfig | None = None

    @property
    def weights_on_device(self) -> bool:
        """Whether versions travel device to device ("ipc" or "broadcast"), so that only
        some are stored (``RunConfig.stores_weights``)."""
        return self.weights_via in ("ipc", "broadcast")


class WandbConfig(_Section):
    """The Weights & Biases sink: offline by default, so it works without a network
    (``wandb sync runs/<run>/wandb/wandb/offline-run-*`` uploads it later)."""

    project: str = "rlbus"
    entity: str | None = None  # None = the key's default entity
    mode: Literal["offline", "online"] = "offline"  # online needs WANDB_API_KEY or a login


class MonitorConfig(_Section):
    """Where a run's metrics go besides the live view, ``summary.json`` and the lake: each
    sink is fed by the monitor role (``rlbus role monitor``), a follower of the run's
    metrics, started by ``rlbus up`` when ``sinks`` is not empty."""

    # "tensorboard": event files under runs/<run>/tb/; "wandb": a W&B run (see [monitor.wandb]).
    sinks: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)
    wandb: WandbConfig = Field(default_factory=WandbConfig)


class Placement(_Section):
    """Where one role process runs: the CPUs it may use and its torch/BLAS threads."""

    cpus: list[Annotated[int, Field(ge=0)]] | None = None  # None: the plan's (or every) CPU
    threads: int | None = Field(default=None, ge=1)  # None: the plan's


class CpusConfig(_Section):
    """How `rlbus up` places role processes on the machine's CPUs (`roles.up.cpu_plan`)."""

    # "auto": the compute roles (trainer ranks, inference replicas) get disjoint CPU
    # slices and as many threads as their slice has, the light roles a few CPUs of their
    # own; with no CPU to spare for those, nothing is pinned. "off": no affinity, one
    # torch thread per role.
    plan: Literal["auto", "off"] = "auto"
    # Overrides by role kind ("trainer", "inference", "env", ...) or process name
    # ("inference-policy-1", "env-reverse-text"); the name wins over the kind.
    roles: dict[str, Placement] = Field(default_factory=dict)


class GatewayConfig(_Section):
    """The OpenAI-compatible endpoint (``roles.gateway``): `rlbus up` starts it when
    enabled, `rlbus serve` always."""

    enabled: bool = False
    host: str = "127.0.0.1"  # loopback unless configured
    port: int = Field(default=8000, ge=0, le=65535)  # 0: any free port (heartbeat says)
    max_tokens: int = Field(default=256, ge=1)  # a request's completion budget when unset
    max_body_bytes: int = Field(default=16 << 20, ge=1024)


class RunConfig(_Section):
    """A whole run: the one object every role is started with."""

    run: RunId | None = None  # None = the CLI generates an id
    seed: int = 0  # root seed; every random choice derives from it and its cause
    max_steps: int = Field(default=40, ge=0)  # trainer steps before the run stops
    bus: BusConfig = Field(default_factory=BusConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    env_server: EnvServerConfig = Field(default_factory=EnvServerConfig)
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    cpus: CpusConfig = Field(default_factory=CpusConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)

    def pinned_versions(self) -> set[int]:
        """Versions a policy snapshot serves (``orchestrator.models.<key>.policy_version``):
        stored and kept for the whole run, so a snapshot's replica can load them."""
        return {
            m.policy_version
            for m in self.orchestrator.models.values()
            if m.policy_version is not None
        }

    def stores_weights(self, version: int) -> bool:
        """Whether the trainer stores ``version``'s bytes: every version, except with
        ``trainer.weights_via`` "ipc" or "broadcast" (device to device), where only every
        ``store_weights_every``-th version, a policy snapshot's and the last are."""
        if not self.trainer.weights_on_device:
            return True
        return (
            version % self.trainer.store_weights_every == 0
            or version >= self.max_steps
            or version in self.pinned_versions()
        )

    def evaluates(self, version: int) -> bool:
        """Whether the orchestrator evaluates policy ``version`` (at start, every
        ``eval.interval`` versions, right after the warm start, at the end). Inference
        asks too: it holds such a version until its eval has been answered."""
        e = self.orchestrator.eval
        if e.interval == 0:
            return False
        warm = self.orchestrator.warmup.steps
        return (
            (version == 0 and e.at_start)
            or (version > 0 and version % e.interval == 0)
            or version == self.max_steps
            or (warm > 0 and version == warm)  # the score right after the warm start
        )

    @model_validator(mode="after")
    def _cross_field(self) -> RunConfig:
        # One error listing every problem: fixing a config one run at a time is slow.
        problems = orchestrator_problems(self.orchestrator)
        if self.trainer.weights_on_device and self.trainer.world_size > 1:
            problems.append(
                f"`trainer.weights_via` = {self.trainer.weights_via!r} sends one trainer "
                "process's weights: set `trainer.world_size` = 1 or another `trainer.weights_via`"
            )
        problems += _lora_problems(self.trainer)
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _lora_problems(t: TrainerConfig) -> list[str]:
    """LoRA trains one process's adapters and sends them as bytes: what it does not do yet
    is refused here, naming the key, before any role starts."""
    if t.lora is None:
        return []
    problems = []
    if t.world_size > 1:
        problems.append(
            "`trainer.lora` trains on one trainer process: set `trainer.world_size` = 1"
        )
    if t.weights_on_device:
        problems.append(
            f"`trainer.weights_via` = {t.weights_via!r} copies whole models device to "
            'device; with `trainer.lora` the adapters travel as bytes: use "auto", '
            '"object", "path" or "shm"'
        )
    return problems
