"""Character-level tokenizer for the tiny model: one token per character.

Built in memory with the `tokenizers` library (no files, no network) and wrapped in a
`transformers.PreTrainedTokenizerFast`, so the tiny model and any real Hugging Face model
go through the same tokenizer API (`encode`, `decode`, `apply_chat_template`).

    python -c "from roles.lib.model.tokenizer import build_tokenizer; \
print(build_tokenizer().apply_chat_template([{'role': 'user', 'content': 'hi'}], \
tokenize=False, add_generation_prompt=True))"

Chat format: every message is `<|{role}|>{content}<|end|>`; a tool result with a `name`
is `<|tool|>{name}:{content}<|end|>`; the generation prompt is `<|assistant|>`, and the
assistant's completion ends with `<|end|>` (the stop token; eos also stops).
Special-token strings typed inside content are parsed as special tokens, as with any HF
tokenizer; the environments we ship never put them in content.

Tool calls: an assistant message with ``tool_calls`` is its content followed by one
``<|tool_call|>{name}:{arguments}`` per call (arguments = the call's JSON object text,
verbatim), then ``<|end|>``:

    <|assistant|><|tool_call|>calc:{"expr":"12+34"}<|end|>

Short on purpose (the tiny model has 256 positions) and parseable without a schema:
``<|tool_call|>`` is one special token, the name runs to the first ``:``, the arguments
to the next ``<|tool_call|>`` or the end. ``format_tool_call`` writes one call as the
model would; ``split_tool_calls`` reads a completion back (``Renderer.parse_tool_calls``
for this template). Tool-call ids never reach the model: the harness derives them.

This module imports `tokenizers`/`transformers` only when a tokenizer is built, so the
format helpers are cheap to import (the built-in envs use them for their scripted
answers).
"""

from __future__ import annotations

import json
import re
import string
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

PAD = "<|pad|>"
BOS = "<|bos|>"
EOS = "<|eos|>"
UNK = "<|unk|>"
END = "<|end|>"
TOOL_CALL = "<|tool_call|>"
ROLE_TOKENS = {role: f"<|{role}|>" for role in ("system", "user", "assistant", "tool")}
# Order fixes the ids: pad must be 0 so zero-filled padding is pad.
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *ROLE_TOKENS.values(), END)
# Special tokens added later take ids after the alphabet, so no earlier id moves.
LATER_SPECIAL_TOKENS = (TOOL_CALL,)

# string.punctuation is exactly `.,:;!?'"-_()[]{}<>/\|=+*#@&%$^~` plus the backtick.
ALPHABET = string.ascii_letters + string.digits + " \n" + string.punctuation

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' and message.get('name') -%}"
    "<|tool|>{{ message['name'] }}:{{ message['content'] }}<|end|>"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "<|assistant|>{{ message['content'] or '' }}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call.get('function') else call -%}"
    "<|tool_call|>{{ fn['name'] }}:"
    "{%- if fn['arguments'] is string -%}{{ fn['arguments'] }}"
    "{%- else -%}{{ fn['arguments'] | tojson }}{%- endif -%}"
    "{%- endfor -%}"
    "<|end|>"
    "{%- else -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

# A tool name: what may stand before the ":" of a call.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]+")


class ToolCallSyntaxError(ValueError):
    """A completion tried a tool call (it wrote the call marker) that does not parse."""


class ParsedToolCall(NamedTuple):
    """One call read from a completion: the tool's name and its JSON object text."""

    name: str
    arguments: str


def format_tool_call(name: str, arguments: dict[str, Any] | str) -> str:
    """One call in the char template's text form, as the model writes it."""
    if not _TOOL_NAME.fullmatch(name):
        raise ValueError(f"tool name {name!r} is not [A-Za-z0-9_.-]+")
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, separators=(",", ":"))
    return f"{TOOL_CALL}{name}:{text}"


def split_tool_calls(text: str) -> tuple[str, list[ParsedToolCall]]:
    """(content, calls) of a completion in the char template's format.

    The content is the text before the first ``<|tool_call|>`` (all of it when there is
    none); each call must be ``name:{JSON object}``, else ``ToolCallSyntaxError`` says
    which call and why.
    """
    content, *segments = text.split(TOOL_CALL)
    calls = []
    for k, segment in enumerate(segments):
        name, sep, arguments = segment.partition(":")
        if not sep or not _TOOL_NAME.fullmatch(name):
            raise ToolCallSyntaxError(f"tool call {k}: expected name:{{...}}, got {segment[:60]!r}")
        try:
            value = json.loads(arguments)
        except ValueError as e:
            raise ToolCallSyntaxError(f"tool call {k} ({name}): arguments are not JSON: {e}") from e
        if not isinstance(value, dict):
            raise ToolCallSyntaxError(f"tool call {k} ({name}): arguments are not a JSON object")
        calls.append(ParsedToolCall(name, arguments))
    return content, calls


def build_vocab() -> dict[str, int]:
    """Special tokens first (pad = 0), then one id per alphabet character, then the
    special tokens added later."""
    return {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *ALPHABET, *LATER_SPECIAL_TOKENS))}


def build_raw_tokenizer() -> Tokenizer:
    """The `tokenizers` object: WordLevel over single characters, unknown -> <|unk|>."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=build_vocab(), unk_token=UNK))
    # `[\s\S]` (not `.`) so newlines are split out too; "isolated" keeps each char.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse concatenates tokens; the default decoder would join them with spaces.
    tok.decoder = decoders.Fuse()
    specials = (*SPECIAL_TOKENS, *LATER_SPECIAL_TOKENS)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The HF-wrapped char tokenizer with pad/bos/eos/unk and the chat template set."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_raw_tokenizer(),
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[*ROLE_TOKENS.values(), END, *LATER_SPECIAL_TOKENS],
        # Cleanup would turn "a ." into "a." and break decode(encode(s)) == s.
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
