# rlbus tasks. `just --list` shows them by group.

set shell := ["bash", "-cu"]

python := env_var_or_default("PYTHON", "python3")

# Install (torch CPU wheel first, then rlbus with dev tools) and start the default run.
# (Arguments pass through as they are: `just up 'monitor.sinks=["tensorboard"]'` works.)
[group('run')]
[positional-arguments]
up *ARGS: install
    {{python}} -m roles.cli up "$@"

# Install torch (CPU) and rlbus with its dev extras into the current Python.
[group('run')]
install:
    @{{python}} -c "import torch" 2>/dev/null || {{python}} -m pip install -q torch==2.13.0
    @{{python}} -c "import roles, nats, msgspec, pytest, tensorboard, wandb, cryptography, renderers, aiohttp, openai, verifiers, peft" 2>/dev/null || {{python}} -m pip install -q -e ".[dev]"

# Run the embedded nats-server (JetStream, loopback) in the foreground.
[group('run')]
nats *ARGS:
    {{python}} -m roles.cli nats {{ARGS}}

# The whole test suite (unit, integration against a real nats-server, e2e with real processes).
[group('test')]
test *ARGS:
    {{python}} -m pytest -q {{ARGS}}

# Measure a default run; rewrite the README's and docs' figures and image (--from-run R: a finished run).
[group('run')]
docs-figures *ARGS: install
    {{python}} -m benchmarks.docs_figures {{ARGS}}

# Only the fast unit tests.
[group('test')]
test-unit *ARGS:
    {{python}} -m pytest -q tests/unit {{ARGS}}

# Benchmarks; results land in benchmarks/results/.
[group('bench')]
bench: bench-startup bench-engine bench-peer bench-overlap bench-profile bench-bus bench-rollouts bench-pools bench-loop bench-lake bench-replay bench-algorithms bench-trace bench-trainer bench-lora bench-faults bench-node-loss bench-weights

# rlbus up's start and stop on a 2-step smoke run: spawn, each role ready, the ordered stop.
[group('bench')]
bench-startup *ARGS:
    {{python}} -m benchmarks.startup_bench {{ARGS}}

# rlbus runtime vs raw nats-py on ~23 KB trace events.
[group('bench')]
bench-bus:
    {{python}} -m benchmarks.bus_bench

# Rollouts/s and where rollout time goes, 1 vs 2 inference replicas.
[group('bench')]
bench-rollouts:
    {{python}} -m benchmarks.rollout_bench

# Rollouts/s with 1 env server vs an elastic env pool (1..3) on the same workload.
[group('bench')]
bench-pools *ARGS:
    {{python}} -m benchmarks.pool_bench {{ARGS}}

# Lint, type-check and check the import contracts ([tool.importlinter] in pyproject.toml).
[group('check')]
lint:
    ruff check .
    ruff format --check .
    mypy
    lint-imports --no-cache

# Format the code.
[group('check')]
fmt:
    ruff check --fix .
    ruff format .

# Remove run directories and caches.
[group('run')]
clean:
    rm -rf runs .pytest_cache .ruff_cache .mypy_cache .hypothesis

# rlbus vs TRL's GRPOTrainer (the `peer` extra) on the same work: s/step, completions/s, eval at equal wall time.
[group('bench')]
bench-peer *ARGS: install
    @{{python}} -c "import trl" 2>/dev/null || {{python}} -m pip install -q -e ".[peer]"
    {{python}} -m benchmarks.peer_bench {{ARGS}}

# rlbus set-ups against each other (and a one-process loop built from rlbus's pieces).
[group('bench')]
bench-overlap *ARGS:
    {{python}} -m benchmarks.overlap_bench {{ARGS}}

# Where a step's time goes: per-role CPU, threads, busy vs waiting, the critical path, a PNG timeline.
[group('bench')]
bench-profile *ARGS:
    {{python}} -m benchmarks.loop_profile {{ARGS}}

# The torch engine against transformers' generate on the default, gpu and a Qwen3-shaped
# model: tokens/s, ms per step, prefix sharing, ops per step (`--quick`; `--device cuda`).
[group('bench')]
bench-engine *ARGS:
    {{python}} -m benchmarks.engine_bench {{ARGS}}

# The learning loop end to end, max_async_level 0 vs 1.
[group('bench')]
bench-loop:
    {{python}} -m benchmarks.loop_bench

# Lake sync rows/s and a DuckDB query over 1 M rollout rows.
[group('bench')]
bench-lake:
    {{python}} -m benchmarks.lake_bench

# Trainer replay speed relative to the original run.
[group('bench')]
bench-replay:
    {{python}} -m benchmarks.replay_bench

# `rlbus trace`: a scan of the whole log vs the lake's index, on one recorded run.
[group('bench')]
bench-trace:
    {{python}} -m benchmarks.trace_bench

# Trainer tokens/s on 1 vs 2 ranks (CPU, gloo, FSDP2), side by side.
[group('bench')]
bench-trainer *ARGS:
    {{python}} -m benchmarks.trainer_bench {{ARGS}}

# LoRA vs full fine-tuning: memory, trained tokens/s, bytes published per step.
[group('bench')]
bench-lora *ARGS:
    {{python}} -m benchmarks.lora_bench {{ARGS}}

# The fault suite's table: bad input, paused roles, kill -9 of every role and the server.
[group('bench')]
bench-faults:
    {{python}} -m benchmarks.fault_bench

# A default-preset run on a 3-node cluster, the stream's leader killed mid-run.
[group('bench')]
bench-node-loss:
    {{python}} -m benchmarks.node_loss_bench

# Attached-worker catch-up speed and the cost of the ce/ref_kl loss channels.
[group('bench')]
bench-algorithms:
    {{python}} -m benchmarks.algorithm_bench

# The gpu preset on one CUDA GPU (not in `just bench`): throughput, MFU, weights lag, mismatch KL.
[group('bench')]
bench-gpu *ARGS:
    {{python}} -m benchmarks.gpu_bench {{ARGS}}

# Weights delivery per trainer.weights_via (object, shm, ipc, broadcast): publish->live lag, swap pause, side by side.
[group('bench')]
bench-weights *ARGS:
    {{python}} -m benchmarks.weights_bench {{ARGS}}
