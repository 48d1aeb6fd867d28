"""The peer bench's pieces that decide whether it compares like with like
(``benchmarks.peer_bench``, ``benchmarks.peer_trl``; TRL itself runs only in the bench):
TRL's reward function is the env's reward of the completion as rlbus reads it, TRL is
given the run config's work, and every ratio reads "rlbus's speed over TRL's"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.peer_bench import POINTS, markdown, report, trl_spec
from benchmarks.peer_trl import reward_func
from configs import load_config
from roles.lib.envs.registry import make_env
from roles.lib.model.loading import load_tokenizer
from roles.lib.model.render import Renderer
from roles.lib.model.tiny import init_model


@pytest.fixture(scope="module")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> Renderer:
    path = tmp_path_factory.mktemp("peer") / "tiny"
    init_model(path, seed=0)
    return Renderer(load_tokenizer(path))


def test_trl_reward_is_the_rubric_of_the_completion_rlbus_reads(renderer: Renderer) -> None:
    """Special tokens sampled inside a completion count as rlbus counts them (TRL's own
    decoding drops them, which scored ~1% of rollouts differently), and the text ends at
    the first stop token."""
    env = make_env("reverse-text", {})
    task = {"text": "mabe"}
    prompt = env.harness.initial_messages(task)
    tok = renderer.tokenizer
    stop = renderer.stop_token_ids[0]
    ebam = tok.encode("ebam", add_special_tokens=False)
    pad_a = [tok.pad_token_id, *tok.encode("a", add_special_tokens=False)]
    scored: list[dict] = []
    reward = reward_func(env, renderer, scored)
    got = reward(
        prompts=[prompt, prompt, prompt],
        completion_ids=[[*ebam, stop], [*ebam, stop, *ebam], [*pad_a, stop]],
        task=[json.dumps(task)] * 3,
    )
    assert got[0] == 1.0 and got[1] == 1.0  # exact, and nothing after the stop token
    as_rlbus = renderer.parse_completion([*pad_a, stop])
    assert as_rlbus != "a"  # the special token stays in the text

    def rubric(text: str) -> float:
        return env.rubric.score([*prompt, {"role": "assistant", "content": text}], task, {}).reward

    assert got[2] == rubric(as_rlbus) < rubric("a")
    assert [s["reward"] for s in scored] == got


def test_trl_gets_the_run_configs_work(tmp_path: Path) -> None:
    cfg = load_config("default", ["trainer.lr=5e-4", "orchestrator.train.sampling.temperature=0.7"])
    spec = trl_spec(cfg, tmp_path / "m", tmp_path / "out", wall=10.0, check=50)
    assert spec["tasks_per_step"] * spec["group_size"] == cfg.orchestrator.batch_size == 64
    assert (spec["lr"], spec["temperature"], spec["max_tokens"]) == (5e-4, 0.7, 12)
    assert (spec["grad_clip"], spec["weight_decay"], spec["betas"]) == (1.0, 0.0, [0.9, 0.999])
    assert spec["std_normalize"] is True and spec["env"] == "reverse-text"
    assert spec["wall_s"] == 20.0 and spec["points"] == [p * 10.0 for p in POINTS]
    other = load_config("default", ["orchestrator.algorithms=[{id='max_rl'}]"])
    with pytest.raises(ValueError, match="GRPO"):
        trl_spec(other, tmp_path, tmp_path, 10.0, 1)


def test_ratios_read_as_rlbus_speed_over_trls() -> None:
    def side(s_per_step: float, trained: float, evals: list[float]) -> dict:
        return {
            "s_per_step": s_per_step, "generated_per_s": trained * 1.1,
            "trained_per_s": trained, "eval": [{"mean": e} for e in evals],
        }  # fmt: skip

    runs = {
        "rlbus": [side(0.1, 640, [0.4, 0.45, 0.5]), side(0.12, 530, [0.41, 0.46, 0.52])],
        "TRL": [side(0.125, 512, [0.38, 0.44, 0.49])],
    }
    out = report(runs, 75.0)
    assert out["over_trl"]["rlbus"]["trained_per_s"] == pytest.approx(585 / 512, abs=1e-3)
    assert out["over_trl"]["rlbus"]["s_per_step"] == pytest.approx(0.125 / 0.11, abs=1e-3)
    assert out["sides"]["rlbus"]["eval"]["1W"] == {"median": 0.455, "min": 0.45, "max": 0.46}
    md = markdown({"summary": out, "wall_W_s": 75.0, "rounds": 2, "seeds": 8, "checks": {}})
    assert "| completions trained / s | 585 (530–640) | 512 (512–512) | 1.14x |" in md
    assert "| eval at 1W (75 s) | 0.455 (0.450–0.460) | 0.440 (0.440–0.440) |  |" in md
