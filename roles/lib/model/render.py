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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Message = dict[str, Any]

# A fixed first message: per-message rendering is "[anchor, msg]" minus "[anchor]".
_ANCHOR: Message = {"role": "user", "content": "x"}
# Stands in for a message's content to find where the template puts the content.
_SENTINEL = "\x00content\x00"


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

    # -- text level -----------------------------------------------------------------

    def _template(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

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

    def message_text(self, message: Message) -> str:
        """One message as the template writes it inside a conversation."""
        base = self._template([_ANCHOR], False)
        alone = _suffix_after(self._template([_ANCHOR, message], False), base)
        return alone if alone is not None else self._template([message], False)

    # -- token level ----------------------------------------------------------------

    def render_prompt(self, messages: Sequence[Message]) -> list[int]:
        """The first prompt of an episode: chat template + generation prompt, as ids."""
        return self._encode(self._template(messages, True))

    def message_tokens(self, message: Message) -> list[int]:
        """One message's tokens (scaffold + content) as they appear mid-conversation."""
        return self._encode(self.message_text(message))

    def split_scaffold(self, message: Message) -> tuple[list[int], list[int], list[int]]:
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
