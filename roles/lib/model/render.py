"""Token-in/token-out chat rendering: the tokens a trace records are the tokens the model saw.

A multi-turn episode is never re-rendered from text. Each turn's prompt is the previous
prompt + the sampled completion tokens (+ `<|end|>` if the completion was cut off) + the
new messages rendered on their own + the generation prompt, so retokenisation can never
drift from what was sampled and every prompt extends the last one.

    r = Renderer(build_tokenizer())
    p0 = r.render_prompt([{"role": "user", "content": "2+2?"}])
    p1 = r.continue_prompt(p0, completion_ids, [{"role": "user", "content": "sure?"}])

Two renderers, one interface (``make_renderer`` picks, ``model.renderer`` names it):

- ``Renderer`` (``"rlbus"``): written for the character tokenizer; for other chat
  templates it renders one message as the difference between a conversation with and
  without it. That is exact only for templates whose turns are independent (the char
  template): ``check_template`` proves it on probe conversations, and ``rlbus up``
  refuses a model whose template fails (preflight), naming the probe.
- ``FamilyRenderer`` (a name from the ``renderers`` package: ``"qwen3"``, ``"llama-3"``,
  ...): that package's hand-written renderer of the family's template (what prime-rl and
  verifiers use). Its ``bridge_to_next_turn`` extends the sampled stream with the new
  messages in the family's framing (Qwen3 groups consecutive tool results in one user
  turn and puts a newline after ``<|im_end|>``, which a per-message difference gets
  wrong), and its parser reads reasoning (``<think>``) and tool calls from token ids.
  Reasoning stays in the context as it was sampled (``thinking_retention = "all"``):
  a template that strips earlier reasoning would make the next prompt stop extending
  the last one, so the trained sequence would not be the one sampled.

The harness drives either through ``first_turn``, ``next_turn`` and ``parse_reply``: each
turn's prompt, which tokens close the last completion, each new message's tokens (and
where its content lies in them) and the generation prompt.

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
from typing import Any, NamedTuple

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
_CHAR_TURN = re.compile(r"<\|(system|user|assistant|tool)\|>(.*?)<\|end\|>", re.S)
# A family's turns in a rendered prompt: (role, body) per match.
_FAMILY_TURNS = {
    "qwen3": re.compile(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", re.S),
    "llama-3": re.compile(
        r"<\|start_header_id\|>(\w+)<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>", re.S
    ),
}
_TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)
_THINK = re.compile(r"^\s*<think>.*?</think>\s*", re.S)
# Llama 3's first user turn carries the tools (an instruction, then one JSON object each).
_LLAMA_TOOLS = re.compile(
    r"^Given the following functions.*?Do not use variables\.\n\n(\{.*?\n\}\n\n)*", re.S
)
# Llama 3's system turn opens with a preamble of its own (dates, tools' environment).
_LLAMA_PREAMBLE = re.compile(
    r"^(Environment: ipython\n)?Cutting Knowledge Date: [^\n]*\nToday Date: [^\n]*\n\n"
)

# A fixed first message: per-message rendering is "[anchor, msg]" minus "[anchor]".
_ANCHOR: Message = {"role": "user", "content": "x"}
_ANCHOR_REPLY: Message = {"role": "assistant", "content": "y"}
# Stands in for a message's content to find where the template puts the content.
_SENTINEL = "\x00content\x00"
_CACHE_SIZE = 4096  # rendered messages kept (cleared when full)
_TURNS_CACHED = 256  # first turns kept (whole prompts: a group needs one; cleared when full)


def _suffix_after(full: str, base: str) -> str | None:
    return full[len(base) :] if full.startswith(base) else None


Span = tuple[int, int] | None  # [start, end) of a message's content inside its tokens


class Turn(NamedTuple):
    """One turn's prompt and where each of its new tokens belongs.

    ``prompt`` = previous prompt + completion + ``close`` + the ``pieces``' tokens +
    ``gen`` (for the first turn: the pieces + ``gen``). ``close`` ends the last completion
    (a synthesised end token, a newline the template writes after it); ``pieces`` are
    the new messages' tokens with their content spans; ``gen`` opens the next reply."""

    prompt: list[int]
    close: list[int]
    pieces: list[tuple[list[int], Span]]
    gen: list[int]


class Reply(NamedTuple):
    """A completion read back: its text (to the stop token), the content an env sees,
    the reasoning it wrote (None when the format has none), its tool calls, and why a
    call did not parse (None when all did)."""

    text: str
    content: str
    reasoning: str | None
    calls: list[ParsedToolCall]
    error: str | None


def completion_text(tokenizer: Any, stop_token_ids: Sequence[int], token_ids: Sequence[int]) -> str:
    """A completion's text, cut at its first stop token (special tokens kept)."""
    ids = list(token_ids)
    cut = next((k for k, t in enumerate(ids) if t in stop_token_ids), len(ids))
    return str(tokenizer.decode(ids[:cut], skip_special_tokens=False))


class TemplateError(ValueError):
    """A turn the renderer cannot extend exactly (the rollout records it and ends)."""


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
        self._turns: dict[str, Turn] = {}  # (messages, tools) JSON -> first turn

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
        return completion_text(self.tokenizer, self.stop_token_ids, token_ids)

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

    # -- turns (the interface the harness uses) -------------------------------------

    def scaffolded(self, message: Message) -> tuple[list[int], Span]:
        """(``message_tokens(message)``, its content span or None when the template does
        not write the content verbatim or the split disagrees with the tokens)."""
        tokens = self.message_tokens(message)
        try:
            prefix, content, suffix = self.split_scaffold(message)
        except ValueError:
            return tokens, None
        if [*prefix, *content, *suffix] != tokens:
            return tokens, None
        return tokens, (len(prefix), len(prefix) + len(content))

    def split_initial_prompt(
        self, messages: Sequence[Message], prompt: Sequence[int]
    ) -> tuple[list[list[int]], list[int]]:
        """(tokens of each opening message, generation-prompt tokens) of the first prompt.

        For templates that add tokens of their own (a default system prompt, a bos), the
        extra leading tokens go to the first message, so the pieces always concatenate
        to exactly ``prompt``."""
        prompt = list(prompt)
        gp = list(self.generation_prompt_ids)
        if gp and prompt[-len(gp) :] == gp:
            body, gen = prompt[: -len(gp)], gp
        else:
            body, gen = prompt, []
        pieces = [self.message_tokens(m) for m in messages]
        if sum(pieces, []) == body:
            return pieces, gen
        tail = sum(pieces[1:], [])
        if len(tail) <= len(body) and body[len(body) - len(tail) :] == tail:
            return [body[: len(body) - len(tail)], *pieces[1:]], gen
        return [body] + [[] for _ in pieces[1:]], gen

    def first_turn(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
    ) -> Turn:
        """The opening turn; memoised, since a group's rollouts all open alike (a fresh
        copy each call: the harness extends its lists)."""
        key = json.dumps([list(messages), tools], sort_keys=True, default=str)
        if (turn := self._turns.get(key)) is None:
            if len(self._turns) >= _TURNS_CACHED:
                self._turns.clear()
            turn = self._turns[key] = self._first_turn(messages, tools)
        return Turn(list(turn.prompt), [], [(list(t), s) for t, s in turn.pieces], list(turn.gen))

    def _first_turn(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None
    ) -> Turn:
        prompt = self.render_prompt(messages, tools)
        pieces, gen = self.split_initial_prompt(messages, prompt)
        out = []
        for m, toks in zip(messages, pieces, strict=True):
            rendered, span = self.scaffolded(m)
            # A piece that also holds template extras has no exact span.
            out.append((toks, span if toks == rendered else None))
        return Turn(prompt, [], out, gen)

    def next_turn(
        self,
        prompt: Sequence[int],
        completion: Sequence[int],
        new_messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> Turn:
        close = self.close_completion(completion)[len(completion) :]
        pieces = [self.scaffolded(m) for m in new_messages]
        gen = list(self.generation_prompt_ids)
        full = [*prompt, *completion, *close, *(t for p, _ in pieces for t in p), *gen]
        return Turn(full, close, pieces, gen)

    def reply_ids(self, text: str) -> list[int]:
        """The tokens a model writes for the reply ``text`` (content, then calls in the
        char template's ``<|tool_call|>name:{...}`` form), ending the turn: the scripted
        teacher's answer."""
        return self._encode(text) + [self.end_token_id]

    def read_conversation(self, prompt: Sequence[int]) -> list[Message]:
        """The messages of a rendered prompt, read back (the char template's turns; a
        tool result's ``name:`` prefix back to its ``name``): the scripted teacher."""
        text = self.tokenizer.decode(list(prompt), skip_special_tokens=False)
        messages: list[Message] = []
        for role, body in _CHAR_TURN.findall(text):
            if role == "tool" and ":" in body:
                name, _, body = body.partition(":")
                messages.append({"role": role, "name": name, "content": body})
            else:
                messages.append({"role": role, "content": body})
        return messages

    def parse_reply(self, completion: Sequence[int], prompt: Sequence[int], tools: bool) -> Reply:
        """The completion read back; tool calls only when the env has ``tools`` (elsewhere
        a stray call marker is text)."""
        text = self.parse_completion(completion)
        if not tools:
            return Reply(text, text, None, [], None)
        try:
            content, calls = self.parse_tool_calls(text)
        except ToolCallSyntaxError as e:
            return Reply(text, text, None, [], str(e))
        return Reply(text, content, None, calls, None)


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


# -- families: the `renderers` package ---------------------------------------------------

# Tokens that identify a family's template in a tokenizer's vocabulary (``"auto"``).
FAMILY_MARKERS: dict[str, tuple[str, ...]] = {
    "qwen3": ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>"),
    "llama-3": (
        "<|begin_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
    ),  # fmt: skip
}


def detect_renderer(tokenizer: Any) -> str:
    """The renderer ``"auto"`` means for ``tokenizer``: a family whose markers its
    vocabulary holds, else ``"rlbus"`` (``Renderer``)."""
    vocab = tokenizer.get_vocab()
    for name, markers in FAMILY_MARKERS.items():
        if all(m in vocab for m in markers):
            return name
    return "rlbus"


def make_renderer(tokenizer: Any, name: str = "auto") -> Renderer | FamilyRenderer:
    """The renderer called ``name`` (``model.renderer``) over ``tokenizer``."""
    if name == "auto":
        name = detect_renderer(tokenizer)
    return Renderer(tokenizer) if name == "rlbus" else FamilyRenderer(tokenizer, name)


def _runs(indices: Sequence[int], count: int) -> tuple[list[int], list[list[int]], list[int]]:
    """Positions of a rendered span split into (leading -1s, one list per message index,
    trailing -1s); a -1 between messages stays with the message before it."""
    lead: list[int] = []
    per: list[list[int]] = [[] for _ in range(count)]
    last = -1
    for pos, i in enumerate(indices):
        if i >= 0:
            per[i].append(pos)
            last = i
        elif last < 0:
            lead.append(pos)
        else:
            per[last].append(pos)
    # Scaffolding after the last message's own tokens (the generation prompt) trails.
    trail: list[int] = []
    while last >= 0 and per[last] and indices[per[last][-1]] < 0:
        trail.insert(0, per[last].pop())
    return lead, per, trail


class FamilyRenderer:
    """A model family's renderer from the ``renderers`` package behind rlbus' interface
    (module docstring). ``name`` is the package's renderer name (``"qwen3"``, ...)."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        from renderers import create_renderer
        from renderers.configs import config_from_name

        try:
            config = config_from_name(name)
        except Exception as e:  # noqa: BLE001 - the package's own error names the choices
            raise ValueError(f"unknown renderer {name!r}: {e}") from None
        if config is None:
            raise ValueError("renderer 'auto' is resolved by make_renderer, not here")
        if "thinking_retention" in type(config).model_fields:
            config = type(config)(
                **{**config.model_dump(exclude={"name"}), "thinking_retention": "all"}
            )
        self.name = name
        self.tokenizer = tokenizer
        self.config: Any = config  # the package's RendererConfig (verifiers' client takes it)
        self.impl: Any = create_renderer(tokenizer, config)
        self.stop_token_ids: list[int] = list(self.impl.get_stop_token_ids())
        self.end_token_id: int = self.stop_token_ids[0]  # the family's turn close
        with_gp = self.impl.render_ids([_ANCHOR], add_generation_prompt=True)
        without = self.impl.render_ids([_ANCHOR], add_generation_prompt=False)
        if with_gp[: len(without)] != without:
            raise ValueError(f"renderer {name!r}: generation prompt does not extend the prompt")
        self.generation_prompt_ids: list[int] = with_gp[len(without) :]

    def render_prompt(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        return list(self.impl.render_ids(list(messages), tools=_tools(tools),
                                         add_generation_prompt=True))  # fmt: skip

    def message_tokens(self, message: Message) -> list[int]:
        """One message's tokens after a user turn and a reply (a hint, a demonstration)."""
        context = [_ANCHOR] if message.get("role") == "assistant" else [_ANCHOR, _ANCHOR_REPLY]
        rendered = self.impl.render([*context, message])
        k = len(context)
        return [
            t for t, i in zip(rendered.token_ids, rendered.message_indices, strict=True) if i == k
        ]

    def _pieces(
        self, rendered: Any, start: int, count: int
    ) -> tuple[list[int], list[tuple[list[int], Span]], list[int]]:
        """(leading scaffold, (tokens, content span) per message, trailing scaffold) of
        ``rendered``'s tokens from ``start`` on."""
        ids = list(rendered.token_ids)[start:]
        indices = list(rendered.message_indices)[start:]
        content = list(rendered.is_content)[start:] if rendered.is_content else []
        lead, per, trail = _runs(indices, count)
        pieces = []
        for positions in per:
            flags = [content[p] for p in positions] if content else []
            inside = [k for k, f in enumerate(flags) if f]
            span = (inside[0], inside[-1] + 1) if inside else None
            if span is not None and len(inside) != span[1] - span[0]:
                span = None  # content in several runs: no one span
            pieces.append(([ids[p] for p in positions], span))
        return [ids[p] for p in lead], pieces, [ids[p] for p in trail]

    def first_turn(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
    ) -> Turn:
        rendered = self.impl.render(list(messages), tools=_tools(tools), add_generation_prompt=True)
        lead, pieces, gen = self._pieces(rendered, 0, len(messages))
        if lead and pieces:  # a bos, a default system turn: the first message carries it
            toks, span = pieces[0]
            pieces[0] = (
                lead + toks,
                None if span is None else (span[0] + len(lead), span[1] + len(lead)),
            )
        return Turn(list(rendered.token_ids), [], pieces, gen)

    def next_turn(
        self,
        prompt: Sequence[int],
        completion: Sequence[int],
        new_messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> Turn:
        head = [*prompt, *completion]
        rendered = self.impl.bridge_to_next_turn(list(prompt), list(completion), list(new_messages),
                                                 tools=_tools(tools))  # fmt: skip
        if rendered is None or list(rendered.token_ids[: len(head)]) != head:
            raise TemplateError(
                f"renderer {self.name!r} cannot extend the sampled turn with "
                f"{[m.get('role') for m in new_messages]} (it would re-render history)"
            )
        close, pieces, gen = self._pieces(rendered, len(head), len(new_messages))
        return Turn(list(rendered.token_ids), close, pieces, gen)

    def reply_ids(self, text: str) -> list[int]:
        """The tokens a model of this family writes for the reply ``text`` (content, then
        any calls written in the char template's form, which the built-in envs' scripted
        answers use), ending the turn: the template's rendering of that assistant
        message after the generation prompt, to its turn close."""
        content, calls = split_tool_calls(text)
        message: Message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {"id": f"call_{k}", "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for k, c in enumerate(calls)
            ]  # fmt: skip
        ids = self.message_tokens(message)
        gp = self.generation_prompt_ids
        if ids[: len(gp)] == gp:
            ids = ids[len(gp) :]
        close = next((k for k, t in enumerate(ids) if t in self.stop_token_ids), len(ids) - 1)
        return ids[: close + 1]

    def read_conversation(self, prompt: Sequence[int]) -> list[Message]:
        """The messages of a rendered prompt, read back (roles and contents; Qwen3's
        tool results as tool messages, reasoning dropped): the scripted teacher."""
        turns = _FAMILY_TURNS.get(self.name)
        if turns is None:
            raise ValueError(f"renderer {self.name!r} cannot read a prompt back")
        text = self.tokenizer.decode(list(prompt), skip_special_tokens=False)
        messages: list[Message] = []
        for role, body in turns.findall(text):
            results = _TOOL_RESPONSE.findall(body) if role == "user" else []
            if results and not _TOOL_RESPONSE.sub("", body).strip():
                messages += [{"role": "tool", "content": r} for r in results]
            elif role == "ipython":
                messages.append({"role": "tool", "content": body})
            elif role == "user" and self.name == "llama-3":
                messages.append({"role": role, "content": _LLAMA_TOOLS.sub("", body)})
            elif role == "system" and self.name == "llama-3":
                if body := _LLAMA_PREAMBLE.sub("", body):  # (none given: the preamble alone)
                    messages.append({"role": role, "content": body})
            else:
                messages.append({"role": role, "content": _THINK.sub("", body)})
        return messages

    def parse_reply(self, completion: Sequence[int], prompt: Sequence[int], tools: bool) -> Reply:
        from renderers import ToolCallParseStatus

        ids = list(completion)
        text = completion_text(self.tokenizer, self.stop_token_ids, ids)
        parsed = self.impl.parse_response(ids, prompt_ids=list(prompt))
        content, reasoning = parsed.content, parsed.reasoning_content
        if not parsed.tool_calls:
            return Reply(text, content, reasoning, [], None)
        if not tools:  # no tools here: the call markup is text of the answer
            raw = "\n".join(c.raw for c in parsed.tool_calls)
            return Reply(text, f"{content}\n{raw}".strip(), reasoning, [], None)
        bad = [
            (k, c) for k, c in enumerate(parsed.tool_calls) if c.status != ToolCallParseStatus.OK
        ]
        if bad:
            k, c = bad[0]
            return Reply(text, text, reasoning, [], f"tool call {k}: {c.status}: {c.raw[:60]!r}")
        calls = [
            ParsedToolCall(str(c.name), c.arguments if isinstance(c.arguments, str)
                           else json.dumps(c.arguments, ensure_ascii=False))
            for c in parsed.tool_calls
        ]  # fmt: skip
        return Reply(text, content, reasoning, calls, None)


def _tools(tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    return list(tools) if tools else None


# -- template checks (``rlbus up`` preflight) -------------------------------------------

_TOOL = {"type": "function", "function": {"name": "calc", "description": "Evaluate.",
         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}  # fmt: skip
_CALL = {"id": "call_0", "type": "function",
         "function": {"name": "calc", "arguments": '{"expr": "1+1"}'}}  # fmt: skip
# (name, opening messages, reply text, messages after the reply, tools)
_PROBES: list[tuple[str, list[Message], list[Message], list[dict[str, Any]] | None]] = [
    ("a user turn", [{"role": "user", "content": "Hi there."}],
     [{"role": "user", "content": "And again?"}], None),
    ("a system prompt and two user turns",
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}],
     [{"role": "user", "content": "More."}], None),
    ("a tool call and its result",
     [{"role": "user", "content": "What is 1+1?"}],
     [{"role": "tool", "tool_call_id": "call_0", "content": "2"}], [_TOOL]),
]  # fmt: skip


def check_template(renderer: Renderer | FamilyRenderer) -> str | None:
    """Why ``renderer`` cannot render this tokenizer's chat template exactly, or None.

    On probe conversations (user turns, a system prompt, a tool call and its result) a
    reply sampled after the first prompt and the turn after it must be exactly the
    template's own rendering of the whole conversation: so every later prompt the
    harness builds by extension is the one the template would write."""
    tok = renderer.tokenizer
    for what, opening, after, tools in _PROBES:
        if tools and isinstance(renderer, Renderer) and renderer.tool_format is None:
            continue  # no tool-call format: nothing to probe
        reply: Message = {"role": "assistant", "content": "" if tools else "Sure."}
        if tools:
            reply["tool_calls"] = [_CALL]
        try:
            want_text = tok.apply_chat_template([*opening, reply, *after], tools=tools,
                                                tokenize=False, add_generation_prompt=True)  # fmt: skip
            want = list(tok.encode(want_text, add_special_tokens=False))
            first = renderer.first_turn(opening, tools)
            if want[: len(first.prompt)] != first.prompt:
                return f"{what}: the first prompt is not where the template's conversation starts"
            # The reply as the template writes it mid-conversation, to its turn close.
            reply_ids = want[len(first.prompt) :]
            close = set(renderer.stop_token_ids)
            cut = next((k for k, t in enumerate(reply_ids) if t in close), len(reply_ids) - 1)
            got = renderer.next_turn(first.prompt, reply_ids[: cut + 1], after, tools).prompt
        except Exception as e:  # noqa: BLE001 - any failure is the answer
            return f"{what}: {type(e).__name__}: {e}"
        if got != want:
            k = next(
                (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)),
            )
            return (
                f"{what}: the next prompt differs from the template's at token {k} "
                f"({tok.decode(got[k : k + 6])!r} vs {tok.decode(want[k : k + 6])!r})"
            )
    return None
