"""Unit tests for the environment API, the built-in envs and the env registry (pure, no bus)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from roles.lib.envs.base import Environment, GeneratedTaskset, Harness, Rubric, split_of_key
from roles.lib.envs.builtin.alphabet_sort import names_by_turn, parse_names
from roles.lib.envs.builtin.reverse_text import lcs_len
from roles.lib.envs.registry import UnknownEnv, builtin_names, env_key, make_env
from roles.lib.model.render import Renderer
from roles.lib.model.tokenizer import ALPHABET, build_tokenizer

ENV_IDS = [
    "reverse-text",
    "alphabet-sort",
    "tool-calc",
    "relay-reverse",
    "examples.word_count_env:make_env",
]


def chat(env: Environment, task: dict, *answers: str) -> list[dict]:
    """A conversation where the assistant gives ``answers`` in turn and the env responds."""
    msgs = env.initial_messages(task)
    state = env.init_state(task)
    for a in answers:
        msgs.append({"role": "assistant", "content": a})
        new, done = env.env_response(msgs, task, state)
        msgs += new
        if done:
            break
    return msgs


def perfect_chat(env: Environment, task: dict, turns: int | None = None) -> list[dict]:
    msgs = env.initial_messages(task)
    state = env.init_state(task)
    for _ in range(turns or env.max_turns):
        msgs.append({"role": "assistant", "content": env.reference_answer(msgs, task)})
        new, done = env.env_response(msgs, task, state)
        if done:
            break
        msgs += new
    return msgs


# -- reverse-text -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [
        ("", "", 0),
        ("abc", "", 0),
        ("abc", "abc", 3),
        ("abcde", "ace", 3),
        ("abc", "xyz", 0),
        ("ab", "ba", 1),
    ],
)
def test_lcs_len(a: str, b: str, n: int) -> None:
    """LCS length is right on hand-checked pairs, in both argument orders."""
    assert lcs_len(a, b) == n
    assert lcs_len(b, a) == n


def test_reverse_text_rubric_on_hand_written_answers() -> None:
    """LCS ratio: 1 iff exact (surrounding whitespace ignored), partial credit, 0 for nothing."""
    env = make_env("reverse-text", {})
    task = {"text": "hello"}  # target "olleh"
    cases = {
        "olleh": 1.0,
        "  olleh\n": 1.0,
        "olle": 4 / 5,
        "ollehxx": 5 / 7,  # extra text is penalised by the longer length
        "hello": 2 / 5,  # LCS("hello", "olleh") = "ll"
        "": 0.0,
        "zzz": 0.0,
        "Olleh": 4 / 5,  # case matters
    }
    for answer, want in cases.items():
        score = env.score(chat(env, task, answer), task, {})
        assert score.reward == pytest.approx(want), answer
        assert score.rewards == {"lcs": pytest.approx(want)}
        assert score.metrics["exact"] == float(want == 1.0)
    # No assistant message at all (e.g. scoring a prompt alone) is reward 0, not an error.
    assert env.score(env.initial_messages(task), task, {}).reward == 0.0


def test_reverse_text_tasks_respect_length_args() -> None:
    """Texts are lowercase letters with lengths inside [min_len, max_len]."""
    env = make_env("reverse-text", {"min_len": 2, "max_len": 4})
    lengths = set()
    for i in range(200):
        text = env.task("train", i)["text"]
        assert text.isalpha() and text.islower()
        lengths.add(len(text))
    assert lengths == {2, 3, 4}
    with pytest.raises(ValueError):
        make_env("reverse-text", {"min_len": 5, "max_len": 3})


# -- alphabet-sort ------------------------------------------------------------------------


def test_parse_names_is_lenient_about_separators() -> None:
    """Commas, newlines and spaces around names are all accepted; empties dropped."""
    assert parse_names("Ada,Bo,Cy") == ["Ada", "Bo", "Cy"]
    assert parse_names("Ada, Bo,\nCy\n") == ["Ada", "Bo", "Cy"]
    assert parse_names("Ada\nBo\nCy") == ["Ada", "Bo", "Cy"]
    assert parse_names("") == []


def test_alphabet_sort_conversation_and_reward_per_turn() -> None:
    """Follow-ups add the task's names; reward is the mean of exact per-turn correctness."""
    env = make_env("alphabet-sort", {"max_turns": 3})
    task = {"names": ["Kai", "Ada", "Sue"], "additions": [["Bo", "Zoe"], ["Cy"]]}
    msgs = chat(env, task, "Ada,Kai,Sue", "Ada,Bo,Kai,Sue,Zoe", "Ada,Bo,Cy,Kai,Sue,Zoe")
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]  # fmt: skip
    assert msgs[1]["content"] == "Kai,Ada,Sue"
    assert msgs[3]["content"] == "Add: Bo,Zoe"
    assert msgs[5]["content"] == "Add: Cy"
    score = env.score(msgs, task, {})
    assert score.reward == 1.0
    assert score.metrics == {"turn_1_correct": 1.0, "turn_2_correct": 1.0, "turn_3_correct": 1.0}

    # Wrong middle turn (forgot Zoe), right otherwise: 2/3.
    msgs = chat(env, task, "Ada, Kai, Sue", "Ada,Bo,Kai,Sue", "Ada\nBo\nCy\nKai\nSue\nZoe")
    score = env.score(msgs, task, {})
    assert score.reward == pytest.approx(2 / 3)
    assert score.metrics["turn_2_correct"] == 0.0

    # Unsorted, or duplicated names, are wrong.
    msgs = chat(env, task, "Kai,Ada,Sue", "Ada,Ada,Bo,Kai,Sue,Zoe")
    assert env.score(msgs, task, {}).metrics == {"turn_1_correct": 0.0, "turn_2_correct": 0.0, "turn_3_correct": 0.0}  # fmt: skip


def test_alphabet_sort_unanswered_turn_counts_zero_and_env_stops() -> None:
    """A turn asked but never answered scores 0; after the last turn the env is done."""
    env = make_env("alphabet-sort", {"max_turns": 2})
    task = {"names": ["Kai", "Ada", "Sue"], "additions": [["Bo"]]}
    msgs = chat(env, task, "Ada,Kai,Sue")  # the follow-up is asked, not answered
    assert msgs[-1] == {"role": "user", "content": "Add: Bo"}
    assert env.score(msgs, task, {}).reward == 0.5
    msgs.append({"role": "assistant", "content": "Ada,Bo,Kai,Sue"})
    assert env.env_response(msgs, task, {}) == ([], True)
    assert env.score(msgs, task, {}).reward == 1.0


def test_alphabet_sort_tasks_shape() -> None:
    """3-4 distinct names, then max_turns-1 follow-ups of 1-2 new names each."""
    env = make_env("alphabet-sort", {"max_turns": 3})
    for i in range(100):
        task = env.task("train", i)
        assert 3 <= len(task["names"]) <= 4
        assert len(task["additions"]) == 2
        assert all(1 <= len(a) <= 2 for a in task["additions"])
        everything = task["names"] + sum(task["additions"], [])
        assert len(set(everything)) == len(everything)
        assert names_by_turn(task)[-1] == sorted(everything)


# -- every env ----------------------------------------------------------------------------


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_reference_answer_scores_one(env_id: str) -> None:
    """A policy that replies reference_answer every turn gets reward 1 on train and eval tasks."""
    env = make_env(env_id, {})
    for split in ("train", "eval"):
        for i in range(20):
            task = env.task(split, i)
            msgs = perfect_chat(env, task)
            assert env.score(msgs, task, env.init_state(task)).reward == 1.0, (split, i, msgs)


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_taskset_deterministic_and_json_able(env_id: str) -> None:
    """Same (args, split, index) gives the same JSON-able task; a different seed changes tasks."""
    a, b = make_env(env_id, {}), make_env(env_id, {})
    tasks = [a.task("train", i) for i in range(50)]
    assert tasks == [b.task("train", i) for i in range(50)]
    assert json.loads(json.dumps(tasks)) == tasks
    other = make_env(env_id, {"seed": 1})
    assert [other.task("train", i) for i in range(50)] != tasks


def test_taskset_same_in_another_process() -> None:
    """Tasks do not depend on the process (no hash() randomisation, no global RNG)."""
    code = (
        "import json; from roles.lib.envs.registry import make_env; "
        "print(json.dumps([[make_env(e, {}).task(s, i) for i in range(10)] "
        "for e in ('reverse-text', 'alphabet-sort', 'tool-calc') for s in ('train', 'eval')]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )  # fmt: skip
    here = [
        [make_env(e, {}).task(s, i) for i in range(10)]
        for e in ("reverse-text", "alphabet-sort", "tool-calc")
        for s in ("train", "eval")
    ]
    assert json.loads(out.stdout) == here


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_train_and_eval_splits_are_disjoint(env_id: str) -> None:
    """No eval task appears in the train split (tasks are assigned to splits by a stable hash)."""
    env = make_env(env_id, {})
    key = json.dumps
    train = {key(env.task("train", i), sort_keys=True) for i in range(2000)}
    evals = {key(env.task("eval", i), sort_keys=True) for i in range(min(500, env.size("eval")))}
    assert evals and not train & evals


def test_task_index_out_of_range_and_bad_split() -> None:
    """Indices outside [0, size) and unknown splits are errors, not silent wraparound."""
    env = make_env("reverse-text", {"train_size": 10})
    assert env.size("train") == 10
    with pytest.raises(IndexError):
        env.task("train", 10)
    with pytest.raises(IndexError):
        env.task("train", -1)
    with pytest.raises(ValueError, match="split"):
        env.task("test", 0)


def test_split_of_key_fraction() -> None:
    """About eval_fraction of keys land in eval, stably."""
    keys = [f"k{i}" for i in range(5000)]
    share = sum(split_of_key(k, 0.1) == "eval" for k in keys) / len(keys)
    assert 0.08 < share < 0.12
    assert [split_of_key(k, 0.1) for k in keys] == [split_of_key(k, 0.1) for k in keys]


def test_prompts_fit_the_tiny_model() -> None:
    """Prompts use the char tokenizer's alphabet; reverse-text prompt+answer < 60 tokens, a
    whole tool-calc episode < 60 and a full alphabet-sort conversation stays well inside 256
    positions."""
    tok = build_tokenizer()
    r = Renderer(tok)
    unk = tok.unk_token_id
    for env_id, limit in (("reverse-text", 60), ("alphabet-sort", 200), ("tool-calc", 60)):
        env = make_env(env_id, {})
        worst = 0
        for i in range(300):
            task = env.task("train", i)
            msgs = perfect_chat(env, task)
            for m in msgs:
                assert set(m["content"]) <= set(ALPHABET), m
            ids = r.render_prompt(msgs[:-1]) + r.message_tokens(msgs[-1])[1:]
            assert unk not in ids
            worst = max(worst, len(ids))
        assert worst < limit, (env_id, worst)


# -- the rubric and the registry ----------------------------------------------------------


def test_rubric_weighted_mean_and_zero_weight_metrics() -> None:
    """reward = sum(w * r) / sum(w) over weighted functions; weight-0 functions are metrics."""
    rubric = Rubric(
        {"a": lambda m, t, s: 1.0, "b": lambda m, t, s: 0.0, "c": lambda m, t, s: 0.5},
        weights={"a": 3.0, "b": 1.0, "c": 0.0},
        metric_funcs={"extra": lambda m, t, s: {"len": float(len(m))}},
    )
    score = rubric.score([{"role": "user", "content": "x"}], {}, {})
    assert score.reward == pytest.approx(0.75)
    assert score.rewards == {"a": 1.0, "b": 0.0}
    assert score.metrics == {"c": 0.5, "len": 1.0}
    with pytest.raises(ValueError, match="unknown"):
        Rubric({"a": lambda m, t, s: 1.0}, weights={"z": 1.0})
    with pytest.raises(ValueError, match="weight > 0"):
        Rubric({"a": lambda m, t, s: 1.0}, weights={"a": 0.0})


def test_registry_builtins_and_unknown_name() -> None:
    """Built-ins load by name; an unknown name's error lists the built-ins."""
    assert builtin_names() == [
        "alphabet-sort",
        "debate",
        "relay-reverse",
        "reverse-text",
        "tool-calc",
    ]
    assert make_env("alphabet-sort", {"max_turns": 2}).max_turns == 2
    with pytest.raises(UnknownEnv) as e:
        make_env("reverse-txt", {})
    assert "alphabet-sort" in str(e.value) and "reverse-text" in str(e.value)
    with pytest.raises(ValueError, match="does not take args"):
        make_env("reverse-text", {"max_lenght": 3})


def test_registry_import_path() -> None:
    """A user env loads by `module:callable`; bad paths and non-envs fail clearly."""
    env = make_env("examples.word_count_env:make_env", {"max_words": 3})
    assert env.name == "word-count"
    task = env.task("train", 0)
    assert 1 <= task["count"] <= 3
    msgs = env.initial_messages(task) + [{"role": "assistant", "content": f"It is {task['count']}."}]  # fmt: skip
    assert env.score(msgs, task, {}).reward == 1.0
    with pytest.raises(UnknownEnv, match="cannot import"):
        make_env("no_such_pkg.envs:make_env", {})
    with pytest.raises(UnknownEnv, match="has no .nope."):
        make_env("examples.word_count_env:nope", {})
    with pytest.raises(TypeError, match="not Environment"):
        make_env("examples.word_count_env:answered_count", {"messages": []})


def test_env_key_is_a_subject_token() -> None:
    """Built-in names are their own key; import paths become valid subject tokens."""
    assert env_key("reverse-text") == "reverse-text"
    assert env_key("examples.word_count_env:make_env") == "examples-word_count_env-make_env"


def test_custom_env_from_parts() -> None:
    """An env assembled from a GeneratedTaskset, Harness and Rubric works end to end."""

    class Tasks(GeneratedTaskset):
        def generate(self, rng):  # type: ignore[no-untyped-def]
            return {"n": rng.randint(0, 99)}

        def key(self, task):  # type: ignore[no-untyped-def]
            return str(task["n"])

    class Echo(Harness):
        def user_prompt(self, task):  # type: ignore[no-untyped-def]
            return str(task["n"])

        def reference_answer(self, messages, task):  # type: ignore[no-untyped-def]
            return str(task["n"])

    env = Environment(
        "echo", Tasks(train_size=5, eval_size=5, eval_fraction=0.5), Echo(None),
        Rubric({"ok": lambda m, t, s: float(m[-1]["content"] == str(t["n"]))}),
    )  # fmt: skip
    task = env.task("eval", 3)
    assert env.initial_messages(task) == [{"role": "user", "content": str(task["n"])}]
    assert env.score(perfect_chat(env, task), task, {}).reward == 1.0


def test_default_demonstration_shows_the_reference_answer() -> None:
    """Harness.demonstration defaults to one hint message "Example: <user> -> <reference>"
    (what opsd prepends); None for a harness with no reference answer."""
    env = make_env("reverse-text", {})
    assert env.demonstration({"text": "hello"}) == [
        {"role": "user", "content": "Example: hello -> olleh"}
    ]

    class NoReference(Harness):
        def user_prompt(self, task):  # type: ignore[no-untyped-def]
            return "hi"

    bare = Environment("bare", env.taskset, NoReference(None), env.rubric)
    assert bare.demonstration({"text": "abc"}) is None


def test_environment_members() -> None:
    """Single-agent envs declare no members; multi-agent envs pass theirs to the constructor."""
    env = make_env("reverse-text", {})
    assert env.members == ()
    duo = Environment("duo", env.taskset, env.harness, env.rubric, members=("alice", "bob"))
    assert duo.members == ("alice", "bob")
