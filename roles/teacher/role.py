"""The scripted teacher: a frozen model endpoint that answers built-in tasks correctly.

    rlbus role teacher --run R --nats-url U --model teacher

A randomly initialised tiny model cannot find the answer format by RL alone; the
standard fix is a short SFT warm start on a stronger model's rollouts. Here the stronger
model is a script: it speaks the same protocol as the inference role (token ids in,
token ids + logprobs out, on ``rl.<run>.infer.<model>``), reads the conversation back
from the prompt tokens, and answers with the env's ``solve`` (what a perfect policy
would say next, computed from the conversation alone: the same information the model
has). Its tokens carry logprob 0 (it is deterministic) and policy version 0.
"""

from __future__ import annotations

import time
from typing import Any

from bus.rpc import Serve
from bus.subjects import infer_queue, infer_subject
from roles.runtime.context import RoleContext
from roles.runtime.role import Role, serve_role
from schemas import GenerateRequest, GenerateResult, InferenceFailed, ScoreRequest
from schemas.arrays import i32, pack_f32, pack_i32


class Teacher(Role):
    role = "teacher"

    def __init__(self, bus: Any, ctx: RoleContext, model: str):
        super().__init__(bus, ctx.instance, ctx.cfg.bus.heartbeat_interval_s)
        self.ctx, self.model = ctx, model
        self.envs: dict[str, Any] = {}
        self.answered = 0

    async def setup(self) -> None:
        from roles.lib.model.loading import load_tokenizer
        from roles.lib.model.render import make_renderer

        # The teacher speaks the policy's tokenizer: its tokens are what the policy trains on.
        self.tokenizer = load_tokenizer(self.ctx.model_dir())
        self.renderer = make_renderer(self.tokenizer, self.ctx.cfg.model.renderer)
        self.log.info("teacher.loaded", model=self.model)

    def subscriptions(self) -> list[Serve]:
        def bad(data: bytes, e: Exception) -> InferenceFailed:
            return InferenceFailed(request_id="", kind="bad_request", message=str(e))

        return [Serve(infer_subject(self.run, self.model), infer_queue(self.model),
                      (GenerateRequest, ScoreRequest), self.answer, bad)]  # fmt: skip

    async def status(self) -> dict[str, object]:
        return {"policy_version": 0, "info": {"answered": str(self.answered)}}

    def env(self, env_id: str) -> Any:
        """The env a request names (an id, or a train env's key), built with its config args
        and turn settings (a harness's ``solve`` may read whose turn it is)."""
        if env_id not in self.envs:
            from roles.lib.envs.registry import make_env, turn_options

            entry = self.ctx.cfg.orchestrator.env(env_id)
            if entry is None:
                self.envs[env_id] = make_env(env_id, {})
            else:
                self.envs[env_id] = make_env(entry.id, dict(entry.args), **turn_options(entry))
        return self.envs[env_id]

    async def answer(self, req: GenerateRequest | ScoreRequest) -> GenerateResult | InferenceFailed:
        if isinstance(req, ScoreRequest):
            return InferenceFailed(
                request_id=req.request_id,
                kind="bad_request",
                message="the scripted teacher cannot score",
            )
        if req.env is None:
            return InferenceFailed(
                request_id=req.request_id,
                kind="bad_request",
                message="the teacher needs the request's env",
            )
        t0 = time.perf_counter()
        try:
            messages = self.renderer.read_conversation(i32(req.prompt_ids).tolist())
            text = self.env(req.env).solve(messages)
        except Exception as e:  # noqa: BLE001 - a teacher that cannot answer says so, per request
            return InferenceFailed(
                request_id=req.request_id, kind="internal", message=f"{type(e).__name__}: {e}"
            )
        ids = self.renderer.reply_ids(text)  # (a call in the model's own format)
        limit = req.sampling.max_completion_tokens
        finish = "stop" if len(ids) <= limit else "length"
        ids = ids[:limit]
        self.answered += 1
        return GenerateResult(
            request_id=req.request_id, completion_ids=pack_i32(ids), logprobs=pack_f32([0.0] * len(ids)),
            finish_reason=finish, policy_version=0, prompt_tokens=len(req.prompt_ids) // 4,
            compute_s=time.perf_counter() - t0,
        )  # fmt: skip


async def main(ctx: RoleContext, model: str = "teacher") -> None:
    bus = await ctx.connect()
    await serve_role(Teacher(bus, ctx, model))


__all__ = ["Teacher", "main"]
