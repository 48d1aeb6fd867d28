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
"""

from __future__ import annotations

import string

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD = "<|pad|>"
BOS = "<|bos|>"
EOS = "<|eos|>"
UNK = "<|unk|>"
END = "<|end|>"
ROLE_TOKENS = {role: f"<|{role}|>" for role in ("system", "user", "assistant", "tool")}
# Order fixes the ids: pad must be 0 so zero-filled padding is pad.
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *ROLE_TOKENS.values(), END)

# string.punctuation is exactly `.,:;!?'"-_()[]{}<>/\|=+*#@&%$^~` plus the backtick.
ALPHABET = string.ascii_letters + string.digits + " \n" + string.punctuation

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' and message.get('name') -%}"
    "<|tool|>{{ message['name'] }}:{{ message['content'] }}<|end|>"
    "{%- else -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def build_vocab() -> dict[str, int]:
    """Special tokens first (pad = 0), then one id per alphabet character."""
    return {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *ALPHABET))}


def build_raw_tokenizer() -> Tokenizer:
    """The `tokenizers` object: WordLevel over single characters, unknown -> <|unk|>."""
    tok = Tokenizer(models.WordLevel(vocab=build_vocab(), unk_token=UNK))
    # `[\s\S]` (not `.`) so newlines are split out too; "isolated" keeps each char.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse concatenates tokens; the default decoder would join them with spaces.
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The HF-wrapped char tokenizer with pad/bos/eos/unk and the chat template set."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_raw_tokenizer(),
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[*ROLE_TOKENS.values(), END],
        # Cleanup would turn "a ." into "a." and break decode(encode(s)) == s.
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
