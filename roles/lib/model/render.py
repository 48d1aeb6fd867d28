"""Token-in/token-out chat rendering: the tokens a trace records are the tokens the model saw.

A multi-turn episode is never re-rendered from text. Each turn's prompt is the previous
prompt + the sampled completion tokens (+ `<|end|>` if the completion was cut off) + the
new messages rendered on their own + the generation prompt, so retokenisation can never
drift from what was sampled and every prompt extends the last one.

    r = Renderer(build_tokenizer())
    p0 = r.render_prompt([{"role": "user", "content": "2+2?"}])
    p1 = r.continue_prompt(p0, completion_ids, [{"role": "user", "content": "sure?"}])

Written for the character tokenizer; for other HF chat templates it renders one message
as the difference between a conversation with and without it (so templates that inject
a default system prompt do not repeat it), which covers the common templates.

A template is a pure function of the messages, and the same messages come back all the
time (a group's rollouts share their task's opening messages; every turn renders its
message two or three ways), so one message's text is computed once per renderer
(``message_text``, ``message_tokens``, ``split_scaffold``: a bounded cache keyed by the
message's JSON) and the anchor's once:
Jinja rendering was the env server's largest per-rollout cost.

Tool calls. Messages are OpenAI-style: an assistant message may carry ``tool_calls``
(``[{"id", "type": "function", "function": {"name", "arguments": JSON text}}]``), a tool
message ``tool_call_id``; both go through the chat template as they are (HF templates
get each call's arguments as a dict, as transformers expects; ``tools``, the env's tool
schemas, go to ``render_prompt``). ``parse_tool_calls`` reads a completion's text back
into (content, calls) in the format of the tokenizer:

- the char tokenizer: ``<|tool_call|>name:{...}`` (``roles.lib.model.tokenizer``);
- a tokenizer with ``<tool_call>`` in its vocabulary (Hermes, Qwen 2.5/3):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks;
- any other: no tool calls (the completion is all content). Subclass and override
  ``parse_tool_calls`` for another format.

A completion that writes the call marker but does not parse raises
``ToolCallSyntaxError`` (the harness masks that turn). Parsing never changes tokens: the
harness records the sampled ids as they are, so the token invariants hold whatever the
completion says.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from roles.lib.model.tokenizer import (
    TOOL_CALL,
    ParsedToolCall,
    ToolCallSyntaxError,
    split_tool_calls,
)

Message = dict[str, Any]

# Hermes-style tool calls (Qwen 2.5/3, Hermes): JSON objects in <tool_call> blocks.
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

# A fixed first message: per-message rendering is "[anchor, msg]" minus "[anchor]".
_ANCHOR: Message = {"role": "user", "content": "x"}
# Stands in for a message's content to find where the template puts the content.
_SENTINEL = "\x00content\x00"
_CACHE_SIZE = 4096  # rendered messages kept (cleared when full)


def _suffix_after(full: str, base: str) -> str | None:
    return full[len(base) :] if full.startswith(base) else None


class Renderer:
    """Chat rendering to token ids for one tokenizer (with a chat template)."""

    def __init__(self, tokenizer: Any, *, end_token: str | None = None) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        # "<|end|>" closes a turn in the char tokenizer; other models close with eos.
        if end_token is None:
            end_token = "<|end|>" if "<|end|>" in vocab else tokenizer.eos_token
        self.end_token_id: int = tokenizer.convert_tokens_to_ids(end_token)
        ids = [self.end_token_id, tokenizer.eos_token_id]
        self.stop_token_ids: list[int] = list(dict.fromkeys(i for i in ids if i is not None))
        self.generation_prompt_ids: list[int] = self._encode(self._generation_prompt_text())
        # The completion format of tool calls: the char template's, Hermes', or none.
        self.tool_format: str | None = (
            "char" if TOOL_CALL in vocab else "hermes" if _HERMES_OPEN in vocab else None
        )
        self._anchor_text = self._template([_ANCHOR], False)
        self._memo: dict[tuple[str, str], Any] = {}  # (what, message JSON) -> result

    # -- text level -----------------------------------------------------------------

    def _template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            [self._template_message(m) for m in messages],
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def _template_message(self, message: Message) -> Message:
        """The message as the chat template wants it: the char template writes a call's
        arguments text verbatim; HF templates expect them as a dict."""
        calls = message.get("tool_calls")
        if not calls or self.tool_format == "char":
            return message
        out = []
        for call in calls:
            fn = dict(call.get("function", call))
            if isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.loads(fn["arguments"])
            out.append({**call, "function": fn})
        return {**message, "tool_calls": out}

    def _encode(self, text: str) -> list[int]:
        # The template already wrote every special token it wants; add none.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _generation_prompt_text(self) -> str:
        with_gp = self._template([_ANCHOR], True)
        without = self._template([_ANCHOR], False)
        suffix = _suffix_after(with_gp, without)
        if suffix is None:
            raise ValueError("chat template's generation prompt does not extend the prompt")
        return suffix

    def _cached(self, what: str, message: Message, compute: Callable[[], Any]) -> Any:
        key = (what, json.dumps(message, sort_keys=True, default=str))
        if key not in self._memo:
            if len(self._memo) >= _CACHE_SIZE:
                self._memo.clear()
            self._memo[key] = compute()
        return self._memo[key]

    def message_text(self, message: Message) -> str:
        """One message as the template writes it inside a conversation."""

        def compute() -> str:
            alone = _suffix_after(self._template([_ANCHOR, message], False), self._anchor_text)
            return alone if alone is not None else self._template([message], False)

        text: str = self._cached("text", message, compute)
        return text

    # -- token level ----------------------------------------------------------------

    def render_prompt(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        """The first prompt of an episode: chat template + generation prompt, as ids.

        ``tools`` (OpenAI function schemas) go to the template; the char template shows
        none (its prompts must stay short), HF templates list them as they do."""
        return self._encode(self._template(messages, True, tools))

    def message_tokens(self, message: Message) -> list[int]:
        """One message's tokens (scaffold + content) as they appear mid-conversation."""
        ids = self._cached(
            "tokens", message, lambda: tuple(self._encode(self.message_text(message)))
        )
        return list(ids)

    def split_scaffold(self, message: Message) -> tuple[list[int], list[int], list[int]]:
        """`message_tokens(message)` cut into (scaffold prefix, content, scaffold suffix)
        (``_split_scaffold``, once per distinct message)."""
        parts = self._cached("split", message, lambda: self._split_scaffold(message))
        return list(parts[0]), list(parts[1]), list(parts[2])

    def _split_scaffold(self, message: Message) -> tuple[list[int], list[int], list[int]]:
        """`message_tokens(message)` cut into (scaffold prefix, content, scaffold suffix).

        The content's span is found by rendering the message with a sentinel in place of
        its content; tokens are assigned by their character offsets, so the three parts
        always concatenate to exactly `message_tokens(message)`.
        """
        content = str(message.get("content", ""))
        text = self.message_text(message)
        marked = self.message_text({**message, "content": _SENTINEL})
        prefix_text, sep, suffix_text = marked.partition(_SENTINEL)
        if not sep or text != prefix_text + content + suffix_text:
            raise ValueError("chat template does not place message content verbatim")
        start, end = len(prefix_text), len(prefix_text) + len(content)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        # First token that ends after the content starts, and first that starts after it ends.
        i = next((k for k, (_, e) in enumerate(offsets) if e > start), len(ids))
        j = (
            i
            if end == start
            else next((k for k in range(i, len(ids)) if offsets[k][0] >= end), len(ids))
        )
        return ids[:i], ids[i:j], ids[j:]

    def parse_completion(self, token_ids: Sequence[int]) -> str:
        """The completion's text, cut at its first stop token (`<|end|>` or eos)."""
        ids = list(token_ids)
        cut = next((k for k, t in enumerate(ids) if t in self.stop_token_ids), len(ids))
        return self.tokenizer.decode(ids[:cut], skip_special_tokens=False)

    def parse_tool_calls(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """(content, calls) of a completion's text (``parse_completion``'s), in this
        tokenizer's tool-call format; ``ToolCallSyntaxError`` when the text starts a
        call that does not parse."""
        if self.tool_format == "char":
            return split_tool_calls(text)
        if self.tool_format == "hermes":
            return _split_hermes(text)
        return text, []

    def close_completion(self, completion_ids: Sequence[int]) -> list[int]:
        """The completion as it stays in the context: ends with a stop token.

        A truncated completion (hit max tokens) gets `<|end|>` so the next message does
        not read as a continuation of the assistant's turn.
        """
        ids = list(completion_ids)
        if not ids or ids[-1] not in self.stop_token_ids:
            ids.append(self.end_token_id)
        return ids

    def continue_prompt(
        self,
        prev_prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        new_messages: Sequence[Message],
    ) -> list[int]:
        """Next turn's prompt: previous prompt + closed completion + new messages + gen prompt."""
        ids = list(prev_prompt_ids) + self.close_completion(completion_ids)
        for message in new_messages:
            ids += self.message_tokens(message)
        return ids + self.generation_prompt_ids


def _split_hermes(text: str) -> tuple[str, list[ParsedToolCall]]:
    """Hermes/Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks:
    the content is the text before the first block (trailing whitespace dropped), only
    whitespace may stand between and after blocks."""
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    calls, pos = [], start
    for k, m in enumerate(_HERMES_BLOCK.finditer(text, start)):
        if text[pos : m.start()].strip():
            raise ToolCallSyntaxError(f"tool call {k}: unexpected {text[pos : m.start()][:60]!r}")
        calls.append(_hermes_call(k, m.group(1)))
        pos = m.end()
    if text[pos:].strip():
        what = "an unclosed <tool_call>" if _HERMES_OPEN in text[pos:] else "text"
        raise ToolCallSyntaxError(f"{what} after the tool calls: {text[pos:][:60]!r}")
    return text[:start].rstrip(), calls


def _hermes_call(k: int, body: str) -> ParsedToolCall:
    """One block's ``{"name": str, "arguments": {...} or its JSON text}``."""
    try:
        value = json.loads(body)
        arguments = value.get("arguments", {}) if isinstance(value, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            arguments = json.loads(arguments)
    except ValueError as e:
        raise ToolCallSyntaxError(f"tool call {k}: not JSON: {e}") from e
    if not isinstance(arguments, dict) or not isinstance(value.get("name"), str):
        raise ToolCallSyntaxError(f'tool call {k}: expected {{"name": str, "arguments": {{...}}}}')
    return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
