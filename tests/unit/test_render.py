"""Unit tests for roles.lib.model.render: token-in/token-out multi-turn rendering."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from roles.lib.model.render import Renderer
from roles.lib.model.tokenizer import ALPHABET, build_tokenizer

TOKENIZER = build_tokenizer()
R = Renderer(TOKENIZER)
END = TOKENIZER.convert_tokens_to_ids("<|end|>")
ASSISTANT = TOKENIZER.convert_tokens_to_ids("<|assistant|>")


def _ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def test_render_prompt_matches_chat_template() -> None:
    """render_prompt is the chat template with generation prompt, as token ids."""
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1"}]
    assert R.render_prompt(messages) == _ids("<|system|>Add.<|end|><|user|>1+1<|end|><|assistant|>")
    assert R.generation_prompt_ids == [ASSISTANT]
    assert R.stop_token_ids == [END, TOKENIZER.eos_token_id]


def test_message_tokens_and_scaffold_split() -> None:
    """split_scaffold separates template scaffolding from content, losslessly."""
    tool = {"role": "tool", "name": "calc", "content": "42"}
    assert R.message_tokens(tool) == _ids("<|tool|>calc:42<|end|>")
    prefix, content, suffix = R.split_scaffold(tool)
    assert (prefix, content, suffix) == (_ids("<|tool|>calc:"), _ids("42"), [END])

    empty = {"role": "user", "content": ""}
    assert R.split_scaffold(empty) == (_ids("<|user|>"), [], [END])


def test_parse_completion_strips_stop_token() -> None:
    """parse_completion decodes up to the stop token (<|end|> or eos)."""
    assert R.parse_completion(_ids("The answer is 4.") + [END]) == "The answer is 4."
    assert R.parse_completion(_ids("cut off") + [TOKENIZER.eos_token_id]) == "cut off"
    assert R.parse_completion(_ids("no stop")) == "no stop"


def test_continue_prompt_closes_truncated_completion() -> None:
    """A completion without a stop token gets <|end|> before the next message."""
    prompt = R.render_prompt([{"role": "user", "content": "hi"}])
    nxt = [{"role": "user", "content": "go on"}]
    truncated = _ids("hel")
    assert R.continue_prompt(prompt, truncated, nxt) == (
        prompt + truncated + [END] + _ids("<|user|>go on<|end|>") + [ASSISTANT]
    )
    finished = _ids("hello") + [END]
    assert R.continue_prompt(prompt, finished, nxt) == (
        prompt + finished + _ids("<|user|>go on<|end|><|assistant|>")
    )
    with_eos = _ids("bye") + [TOKENIZER.eos_token_id]
    assert R.continue_prompt(prompt, with_eos, [])[len(prompt) :] == with_eos + [ASSISTANT]


# "<" is left out of completions so no run of sampled chars spells a special token.
_completion = st.text(alphabet=ALPHABET.replace("<", ""), max_size=10).map(_ids)
_turn = st.tuples(
    _completion,
    st.booleans(),  # did the completion end with <|end|> (else it was truncated)?
    st.lists(
        st.tuples(st.sampled_from(["user", "tool"]), st.text(alphabet=ALPHABET, max_size=12)),
        min_size=1,
        max_size=2,
    ),
)


@settings(max_examples=50, deadline=None)
@given(st.lists(_turn, min_size=1, max_size=4))
def test_multi_turn_prompts_extend_and_concatenate(turns: list) -> None:
    """Each prompt extends the last prompt + completion; the final prompt is the recorded
    pieces concatenated and equals the template of the whole conversation (no drift)."""
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]
    prompt = R.render_prompt(messages)
    pieces = [prompt]
    for completion, finished, new in turns:
        completion = completion + [END] if finished else completion
        new_messages = [{"role": role, "content": c, "name": "t"} for role, c in new]
        nxt = R.continue_prompt(prompt, completion, new_messages)
        assert nxt[: len(prompt) + len(completion)] == prompt + completion
        pieces.append(nxt[len(prompt) :])
        prompt = nxt
        # A truncated completion is closed with <|end|>, so it reads as a whole message.
        messages.append({"role": "assistant", "content": R.parse_completion(completion)})
        messages.extend(new_messages)
    assert prompt == [t for piece in pieces for t in piece]
    assert prompt == R.render_prompt(messages)


def test_char_template_reads_tool_calls_and_hides_tool_schemas() -> None:
    """The char tokenizer's renderer parses <|tool_call|> calls; tool schemas passed to
    render_prompt are not shown (the tiny model's prompts stay short)."""
    assert R.tool_format == "char"
    messages = [{"role": "user", "content": "1+1"}]
    schema = {"type": "function", "function": {"name": "calc", "parameters": {}}}
    assert R.render_prompt(messages, [schema]) == R.render_prompt(messages)
    content, calls = R.parse_tool_calls('sum<|tool_call|>calc:{"expr":"1+1"}')
    assert content == "sum" and [(c.name, c.arguments) for c in calls] == [
        ("calc", '{"expr":"1+1"}')
    ]


def test_a_groups_opening_is_rendered_once_and_each_rollout_gets_its_own_copy() -> None:
    """first_turn is memoised (a group's rollouts all open alike): the same turn as a
    fresh render, rendered once, and a copy a rollout may extend without touching the
    next rollout's."""
    renderer = Renderer(TOKENIZER)
    opening = [{"role": "system", "content": "Reverse."}, {"role": "user", "content": "abc"}]
    fresh = Renderer(TOKENIZER)._first_turn(opening, None)
    first = renderer.first_turn(opening)
    assert first == fresh
    first.prompt.append(END)
    first.pieces[0][0].append(END)
    first.gen.append(END)
    again = renderer.first_turn(opening)
    assert again == fresh and len(renderer._turns) == 1
    # Other messages or tools: another turn.
    assert renderer.first_turn(opening[1:]) != fresh and len(renderer._turns) == 2
