"""The peer's side of ``benchmarks.peer_bench``: TRL's ``GRPOTrainer`` on rlbus's work.

Run in its own process by the bench (``python -m benchmarks.peer_trl SPEC.json``), so its
thread count, imports and allocator are its own. ``SPEC.json`` says what to train and
for how long:

- ``model``: the exported warm-start model directory both sides start from;
- ``env`` / ``env_args``: the rlbus env whose train split gives the prompts (the env's
  opening messages, rendered by the model's chat template as TRL renders a conversational
  prompt) and whose rubric is the reward function (the completion as TRL decodes it,
  scored as rlbus scores a rollout's messages);
- ``tasks_per_step`` x ``group_size`` completions per step, ``max_tokens``, sampling,
  the trainer's AdamW settings and grad clip, ``seed``, ``threads``;
- ``wall_s``: training stops at the first step ending past it; ``points``: wall times
  (seconds since training began) at which the policy is kept: the weights after the last
  step that ended at or before each, written as a model directory under ``out``.

Time counts from ``on_train_begin`` (the model is loaded, the first step not begun) and
leaves out the time spent writing those directories. It writes ``out/trl.json``: per
step its end time, mean reward and completions; the kept points; and the first
``record`` rollouts' prompt and completion token ids (what TRL generated, for the
bench's equality checks).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch


def conversation(env: Any, index: int) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """Train task ``index``: its opening messages (TRL's conversational prompt) and data."""
    task = env.task("train", index)
    return env.harness.initial_messages(task), task


def reward_func(env: Any, renderer: Any, scored: list[dict[str, Any]] | None = None) -> Any:
    """TRL's reward function: the env's rubric (``Score.reward``, what a rollout's
    ``Trace.reward`` is) over the prompt and the completion as rlbus reads it (its text to
    the first stop token, special tokens kept: ``Renderer.parse_completion``; TRL's own
    text drops special tokens, which changes the reward of ~1% of rollouts here). ``scored``
    gets each (task, completion, reward), in TRL's order."""

    def reward(
        prompts: list[Any], completion_ids: list[list[int]], task: list[str], **_: Any
    ) -> list[float]:
        out = []
        for prompt, ids, data in zip(prompts, completion_ids, task, strict=True):
            completion = [{"role": "assistant", "content": renderer.parse_completion(ids)}]
            state = env.harness.init_state({})
            value = env.rubric.score([*prompt, *completion], json.loads(data), state).reward
            out.append(value)
            if scored is not None:
                scored.append({"task": data, "completion": completion, "reward": value})
        return out

    reward.__name__ = env.name
    return reward


def main(spec_path: str) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from roles.lib.envs.registry import make_env
    from roles.lib.model.loading import load_tokenizer
    from roles.lib.model.render import Renderer

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(spec["threads"])
    env = make_env(spec["env"], spec["env_args"])
    steps_cap = spec["max_steps"]
    rows = []
    for i in range(steps_cap * spec["tasks_per_step"]):
        prompt, task = conversation(env, i)
        rows.append({"prompt": prompt, "task": json.dumps(task)})
    dataset = Dataset.from_list(rows)
    model_dir = Path(spec["model"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        bf16=False,
        seed=spec["seed"],
        max_steps=steps_cap,
        per_device_train_batch_size=spec["tasks_per_step"] * spec["group_size"],
        num_generations=spec["group_size"],
        max_completion_length=spec["max_tokens"],
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        top_k=spec["top_k"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=spec["betas"][0],
        adam_beta2=spec["betas"][1],
        weight_decay=spec["weight_decay"],
        max_grad_norm=spec["grad_clip"],
        beta=0.0,  # no KL term: rlbus's default kl_coef = 0
        scale_rewards="group" if spec["std_normalize"] else "none",
        loss_type="dapo",  # token-level mean over the batch: rlbus's normalize = "tokens"
        epsilon=spec["epsilon_low"],
        epsilon_high=spec["epsilon_high"],
        # TRL's defaults that rlbus does not do: activation checkpointing (GRPOConfig turns
        # it on; it recomputes a forward in every backward) and the fused AdamW kernel
        # (rlbus steps torch's AdamW): off, so the peer trains as rlbus trains.
        gradient_checkpointing=False,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    scored: list[dict[str, Any]] = []
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_func(env, Renderer(load_tokenizer(model_dir)), scored),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )

    trainer.remove_callback(PrinterCallback)  # a dict printed per step: the log is ours
    generated: list[dict[str, list[int]]] = []
    generate_one = trainer._generate_single_turn

    def generate_recorded(prompt_ids: Any, *args: Any, **kwargs: Any) -> Any:
        completion_ids, logprobs = generate_one(prompt_ids, *args, **kwargs)
        if len(generated) < spec["record"]:
            generated.extend(
                {"prompt_ids": list(p), "completion_ids": list(c)}
                for p, c in zip(prompt_ids, completion_ids, strict=True)
            )
        return completion_ids, logprobs

    trainer._generate_single_turn = generate_recorded  # type: ignore[method-assign]

    points = sorted(spec["points"])
    kept: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        """Step end times, the policy kept at each point, and the stop at ``wall_s``."""

        def __init__(self) -> None:
            self.t0 = 0.0
            self.paused = 0.0  # seconds spent writing kept policies, off the clock
            self.last: dict[str, torch.Tensor] | None = None
            self.last_step = 0
            self.last_t = 0.0

        def now(self) -> float:
            return time.perf_counter() - self.t0 - self.paused

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0 = time.perf_counter()
            self.last = {k: v.detach().clone() for k, v in model.state_dict().items()}

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            t = self.now()
            paused = time.perf_counter()
            while points and t > points[0]:  # the policy before this step is point's
                self.keep(points.pop(0))
            self.last = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.last_step, self.last_t = state.global_step, t
            self.paused += time.perf_counter() - paused
            steps.append({"step": state.global_step, "t": round(t, 4)})
            if t >= spec["wall_s"]:
                while points:
                    self.keep(points.pop(0))
                control.should_training_stop = True
            return control

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "reward" in logs and steps:
                steps[-1]["reward"] = logs["reward"]

        def keep(self, point: float) -> None:
            where = out / f"policy-{point:g}"
            shutil.rmtree(where, ignore_errors=True)
            assert self.last is not None
            model.save_pretrained(where, state_dict=self.last)
            tokenizer.save_pretrained(where)
            kept.append(
                {"point": point, "step": self.last_step, "t": round(self.last_t, 4),
                 "path": str(where)}
            )  # fmt: skip
            print(f"trl: kept step {self.last_step} (t={self.last_t:.1f}s) for {point:g}s",
                  flush=True)  # fmt: skip

    trainer.add_callback(Clock())
    trainer.train()
    record = {
        "threads": spec["threads"],
        "torch": torch.__version__,
        "trl": __import__("trl").__version__,
        "steps": steps,
        "kept": kept,
        "completions_per_step": spec["tasks_per_step"] * spec["group_size"],
        # The first rollouts: prompt and completion ids as generated, then the task,
        # completion and reward as scored (one batch's rollouts, in the same order).
        "recorded": [g | s for g, s in zip(generated, scored, strict=False)][: spec["record"]],
    }
    (out / "trl.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1])
