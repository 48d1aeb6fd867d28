"""`rlbus up` refuses a config it cannot run before any role starts, in one line naming the key.

The command-line tests run `python -m roles.cli up` as a user does, with the data
directory in a temporary folder: a bad model path, an unknown env (as an override and
in a TOML file) and an unknown algorithm each exit 2 with one stderr line, and leave no
run directory (so no role log) behind. The rest call `roles.up.preflight` directly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from configs import ConfigError, RunConfig, load_config
from roles.lib.model.tokenizer import build_tokenizer
from roles.up import preflight

RLBUS = [sys.executable, "-m", "roles.cli"]
RUN = "pf1"


def up(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLBUS_")}
    cmd = [*RLBUS, "up", "--run", RUN, "--no-view", *args, f"bus.data_dir={data}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def assert_refused(out: subprocess.CompletedProcess[str], data: Path, key: str) -> None:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("config error: ") and f"`{key}`" in lines[0], lines[0]
    assert not (data / RUN).exists(), "a role (or its log) was started"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.path=/no/such/model", "model.path"),
        ("orchestrator.train.env.0.id=nope", "orchestrator.train.env.0.id"),
        ("orchestrator.algorithms.0.name=nope", "orchestrator.algorithms.0.name"),
        ("inference.kv_cache_gb=0.00001", "inference.kv_cache_gb"),
    ],
)
def test_up_refuses_a_bad_config_before_any_role_starts(
    tmp_path: Path, override: str, key: str
) -> None:
    out = up(tmp_path, "-c", "smoke", override)
    assert_refused(out, tmp_path, key)


def test_an_unknown_env_in_a_toml_file_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "my_run.toml"
    config.write_text('[[orchestrator.train.env]]\nid = "nope"\n')
    out = up(tmp_path, "-c", str(config))
    assert_refused(out, tmp_path, "orchestrator.train.env.0.id")
    assert "unknown env 'nope'" in out.stderr and "reverse-text" in out.stderr


def test_the_dry_run_runs_the_same_checks(tmp_path: Path) -> None:
    """A dry run that passed a config `up` then rejects would be a trap (preflight's docstring)."""
    out = up(tmp_path, "--dry-run", "-c", "smoke", "model.path=/no/such/model")
    assert_refused(out, tmp_path, "model.path")
    assert out.stdout == ""


# -- the checks themselves ------------------------------------------------------------------


def smoke(tmp_path: Path, *overrides: str) -> RunConfig:
    return load_config("smoke", [f"bus.data_dir={tmp_path}", *overrides])


def test_the_smoke_config_passes(tmp_path: Path) -> None:
    preflight.check(smoke(tmp_path))


def test_a_directory_that_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError, match=r"^`model.path`: .* not a model directory \(no config.json\)$"):  # fmt: skip
        preflight.check(smoke(tmp_path, f"model.path={tmp_path / 'm'}"))
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="has no weights"):
        preflight.check(smoke(tmp_path, f"model.path={tmp_path / 'm'}"))
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    with pytest.raises(
        ConfigError, match=r"^`model.path`: no tokenizer loads from .*m: ValueError"
    ):
        preflight.check(smoke(tmp_path, f"model.path={tmp_path / 'm'}"))
    build_tokenizer().save_pretrained(tmp_path / "m")  # the tokenizer and its chat template
    preflight.check(smoke(tmp_path, f"model.path={tmp_path / 'm'}"))


def test_a_hub_id_must_be_cached_when_downloads_are_off(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither a local directory nor in the Hugging Face cache"):  # fmt: skip
        preflight.check(smoke(tmp_path, "model.path=no-such-org/no-such-model"))


def test_a_reference_model_path_is_checked_but_a_teachers_is_not(tmp_path: Path) -> None:
    ref = 'orchestrator.models.ref={kind="reference", path="/no/such/ref"}'
    with pytest.raises(ConfigError, match=r"^`orchestrator.models.ref.path`: /no/such/ref does not exist"):  # fmt: skip
        preflight.check(smoke(tmp_path, ref))
    preflight.check(smoke(tmp_path, "orchestrator.models.teacher.path=/no/such/teacher"))


def test_every_problem_is_named_on_one_line(tmp_path: Path) -> None:
    cfg = smoke(tmp_path, "model.path=/no/model", "orchestrator.train.env.0.args={nope=1}")
    with pytest.raises(ConfigError) as e:
        preflight.check(cfg)
    assert "\n" not in str(e.value)
    assert "`model.path`" in str(e.value) and "`orchestrator.train.env.0.args`" in str(e.value)


def test_a_warmup_algorithm_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"`orchestrator.warmup.algorithms`: unknown algorithm 'nope'"):  # fmt: skip
        preflight.check(smoke(tmp_path, 'orchestrator.warmup.algorithms=["nope"]'))


def test_too_little_free_disk_says_how_much_is_needed(tmp_path: Path) -> None:
    need = shutil.disk_usage(tmp_path).free // preflight.GIB + 2
    problems = preflight.data_dir_problems(smoke(tmp_path), min_free=need * preflight.GIB)
    assert len(problems) == 1
    assert problems[0].startswith(f"`bus.data_dir` ({tmp_path}): ")
    assert problems[0].endswith(f"GiB free, rlbus up needs at least {need} GiB")


def test_a_data_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    cfg = smoke(tmp_path / "f")
    assert preflight.data_dir_problems(cfg) == [
        f"`bus.data_dir` ({tmp_path / 'f'}): exists and is not a directory"
    ]


def test_online_wandb_without_a_key_is_refused_up_front(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    cfg = smoke(tmp_path, 'monitor.sinks=["wandb"]', "monitor.wandb.mode=online")
    with pytest.raises(ConfigError, match=r"`monitor.wandb.mode`: .* needs a W&B key"):
        preflight.check(cfg)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    preflight.check(cfg)  # with a key it starts


def model_dir(tmp_path: Path, **config: object) -> Path:
    """A model directory with ``config.json``, an empty weights file and the char
    tokenizer."""
    import json

    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"")
    build_tokenizer().save_pretrained(path)
    return path


def test_a_model_the_engine_does_not_run_is_refused_pointing_at_vllm(tmp_path: Path) -> None:
    """The torch engine runs the Llama family; another architecture is refused at once,
    naming the backend that would serve it (vLLM's backend is not judged here)."""
    path = model_dir(tmp_path, model_type="gpt2", num_attention_heads=2, num_hidden_layers=1,
                     hidden_size=32, max_position_embeddings=64)  # fmt: skip
    with pytest.raises(ConfigError, match=r"^`model.path`: the torch engine runs llama, .* this one is 'gpt2': serve it with inference.backend = 'vllm'$"):  # fmt: skip
        preflight.check(smoke(tmp_path, f"model.path={path}"))


def test_a_kv_cache_too_small_for_the_models_length_is_refused_naming_the_keys(
    tmp_path: Path,
) -> None:
    """A Qwen3-0.6B-shaped model with its 40,960 positions does not fit 4 sequences in the
    CPU's default 2 GB: refused, naming `inference.kv_cache_gb` and `inference.max_model_len`;
    a shorter max_model_len fits."""
    path = model_dir(tmp_path, model_type="qwen3", num_attention_heads=16, num_key_value_heads=8,
                     head_dim=128, num_hidden_layers=28, hidden_size=1024,
                     max_position_embeddings=40960)  # fmt: skip
    cfg = smoke(tmp_path, f"model.path={path}", 'inference.device="cpu"')
    with pytest.raises(ConfigError, match=r"`inference.kv_cache_gb` \(model.path\): .*holds fewer than 4 sequences of 40960 tokens.*`inference.max_model_len`"):  # fmt: skip
        preflight.check(cfg)
    preflight.check(
        smoke(
            tmp_path, f"model.path={path}", 'inference.device="cpu"', "inference.max_model_len=1024"
        )
    )


def test_an_unknown_eval_only_env_is_refused_before_any_role_starts(tmp_path: Path) -> None:
    """An `[[orchestrator.eval.env]]` id that names no env is refused by `rlbus up` in one
    line naming its key, nothing started; so are args its env does not take."""
    out = up(tmp_path, "-c", "smoke", 'orchestrator.eval.env=[{id="reverse-text"}, {id="nope"}]')
    assert_refused(out, tmp_path, "orchestrator.eval.env.1.id")
    cfg = load_config("smoke", ['orchestrator.eval.env=[{id="alphabet-sort", args={bogus=1}}]'])
    assert preflight.eval_env_problems(cfg) == [
        "`orchestrator.eval.env.0.args`: env 'alphabet-sort' does not take args ['bogus']: "
        "got an unexpected keyword argument 'bogus'"
    ]
    ok = load_config("smoke", ['orchestrator.eval.env=[{id="alphabet-sort", num_tasks=2}]'])
    assert preflight.eval_env_problems(ok) == []


def test_a_renderer_that_cannot_render_the_models_template_is_refused(tmp_path: Path) -> None:
    """`model.renderer` is checked against the model's own chat template before any role
    starts: an unknown name, a family whose tokens the tokenizer lacks, and rlbus' own
    renderer on Qwen3's template (it drifts by a newline) each fail in one line naming
    the key; `auto` (Qwen3's renderer) and the tiny Qwen3 built in the run dir pass."""
    from roles.lib.model.families import build_family_model

    model = build_family_model(tmp_path / "q3", "qwen3")
    for renderer, why in [
        ("bogus", r"^`model.renderer` \('bogus'\): unknown renderer 'bogus': .*'qwen3'"),
        ("llama-3", r"^`model.renderer` \('llama-3'\): Special token '<\|begin_of_text\|>' not found"),
        ("rlbus", r"^`model.renderer` \('rlbus' = 'rlbus'\) cannot render the chat template .* "
                  r"a user turn: the next prompt differs from the template's at token 20"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            preflight.check(smoke(tmp_path, f"model.path={model}", f"model.renderer={renderer}"))
    preflight.check(smoke(tmp_path, f"model.path={model}"))
    preflight.check(smoke(tmp_path, "model.tiny.arch=qwen3", "model.renderer=qwen3"))
    with pytest.raises(ConfigError, match=r"`model.renderer` \('rlbus' = 'rlbus'\) cannot"):
        preflight.check(smoke(tmp_path, "model.tiny.arch=qwen3", "model.renderer=rlbus"))


# A ChatML template in the style of Qwen2's (no newline between turns), which rlbus's own
# renderer renders exactly but the scripted teacher cannot read back (issue: a Hugging
# Face model with `-c smoke` looped on the teacher's errors without training a step).
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


def test_a_warm_start_the_teacher_cannot_read_is_refused_in_one_line(tmp_path: Path) -> None:
    """A BPE model with a ChatML template, rendered by rlbus's renderer, under `-c smoke`
    (which warms up with the scripted teacher): `rlbus up` refuses it in one line naming
    `orchestrator.warmup` and what to set, before any role starts; without the warm start
    it passes, and so does the Qwen3 family's template (its renderer reads prompts back)."""
    import json

    from roles.lib.model.families import build_family_model

    model = build_family_model(tmp_path / "chatml", "qwen3")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CHATML}))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    out = up(tmp_path, "-c", "smoke", f"model.path={model}", "model.renderer=rlbus")
    assert_refused(out, tmp_path, "orchestrator.warmup")
    assert "`orchestrator.warmup.steps = 0`" in out.stderr and "'reverse-text'" in out.stderr
    preflight.check(
        smoke(
            tmp_path, f"model.path={model}", "model.renderer=rlbus", "orchestrator.warmup.steps=0"
        )
    )
    assert preflight.teacher_problems(smoke(tmp_path, "model.tiny.arch=qwen3")) == []
