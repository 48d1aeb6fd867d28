"""Models of real families built here: a BPE tokenizer, a chat template, random weights.

No model hub is reachable where rlbus is tested, yet its users arrive with Qwen3 or Llama
checkpoints. ``build_family_model`` writes a directory shaped like theirs: a byte-level
BPE tokenizer trained with ``tokenizers`` on text rlbus generates (its built-in envs'
tasks and answers, the templates' own scaffolding), the family's special tokens, a chat
template written in the style of the family's real one, and a model of the family's
architecture with random weights (``transformers`` config). Same arch, size and seed:
byte-identical files.

- ``qwen3``: ``<|im_start|>role\\n...<|im_end|>``, tools listed in the system turn,
  ``<tool_call>{json}</tool_call>`` calls, tool results in a user turn's
  ``<tool_response>`` blocks, ``<think>`` reasoning that the template strips from turns
  before the last user query.
- ``llama``: Llama 3.2's ``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``,
  a system turn always present (a default preamble with dates), tools in the first user
  message, one ``{"name", "parameters"}`` call per assistant turn, ``ipython`` results.

The templates are what ``renderers`` (the package) mirrors for these families, so its
hand-written renderer and ``apply_chat_template`` agree token for token (tested).

    rlbus model init --arch qwen3 --out /tmp/q3      # or: --arch llama, --size small
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Named shapes (`rlbus model init --size`); a run's `model.tiny` gives its own.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        intermediate_size=256,
        max_position_embeddings=1024,
        vocab_size=768,
    ),  # fmt: skip
    "small": dict(
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        intermediate_size=768,
        max_position_embeddings=2048,
        vocab_size=2048,
    ),  # fmt: skip
}

QWEN3_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, \
"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == 'user' and message.content is string \
and not (message.content.startswith('<tool_response>') \
and message.content.endswith('</tool_response>')) %}
{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = '' %}
{%- if message.reasoning_content is string %}{%- set reasoning = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' \
+ content.lstrip('\\n') }}
{%- else %}{{- '<|im_start|>assistant\\n' + content }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}
{%- set fn = call.function if call.function else call %}
{{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}\
{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

_LLAMA_FORMAT = (
    'Respond in the format {"name": function name, "parameters": dictionary of argument '
    "name and its value}.Do not use variables.\\n\\n"
)
LLAMA_TEMPLATE = (
    """\
{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if messages[0].role == 'system' %}
{%- set system_message = messages[0].content | trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\\n' }}
{{- 'Today Date: ' + date_string + '\\n\\n' }}
{%- if tools is not none and not tools_in_user_message %}
{{- 'You have access to the following functions. To call a function, please respond with \
JSON for a function call."""
    + _LLAMA_FORMAT
    + """' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{%- endif %}
{{- system_message }}{{- '<|eot_id|>' }}
{%- if tools_in_user_message and tools is not none %}
{%- if messages | length != 0 %}
{%- set first_user_message = messages[0].content | trim %}{%- set messages = messages[1:] %}
{%- else %}{{- raise_exception('Cannot put tools in the first user message when there is none.') }}
{%- endif %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
{{- 'Given the following functions, please respond with a JSON for a function call with its \
proper arguments that best answers the given prompt.\\n\\n"""
    + _LLAMA_FORMAT
    + """' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{{- first_user_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or message.tool_calls) %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' \
+ message.content | trim + '<|eot_id|>' }}
{%- elif message.tool_calls %}
{%- if message.tool_calls | length != 1 %}\
{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}
{%- set call = message.tool_calls[0] %}{%- set fn = call.function if call.function else call %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{{- '{"name": "' + fn.name + '", "parameters": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
{%- if message.content is mapping or message.content is iterable %}\
{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\
{%- endif %}"""
)


@dataclass(frozen=True)
class Family:
    """What a family's directory holds besides its weights."""

    arch: str  # transformers model_type
    renderer: str  # the `renderers` package's name for its renderer
    special: tuple[str, ...]  # special tokens (atomic, skipped when decoding)
    added: tuple[str, ...]  # atomic tokens that decode as text (Qwen3's markup)
    eos: str
    pad: str
    stops: tuple[str, ...]  # tokens that end a completion
    template: str
    digits: int  # digits a pre-token may hold (Qwen: 1, Llama 3: up to 3)
    bos: str | None = None

    @property
    def split_regex(self) -> str:
        """The family's pre-tokenizer pattern: contractions, words, digit runs,
        punctuation runs, newline runs and other whitespace are split before BPE (so
        text encoded in pieces merges as it does whole, which renderers rely on)."""
        n = r"\p{N}" if self.digits == 1 else rf"\p{{N}}{{1,{self.digits}}}"
        return (
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
            + n
            + r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        )


FAMILIES: dict[str, Family] = {
    "qwen3": Family(
        arch="qwen3",
        renderer="qwen3",
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added=(
            "<tool_call>",
            "</tool_call>",
            "<think>",
            "</think>",
            "<tool_response>",
            "</tool_response>",
        ),  # fmt: skip
        eos="<|im_end|>",
        pad="<|endoftext|>",
        stops=("<|im_end|>", "<|endoftext|>"),
        template=QWEN3_TEMPLATE,
        digits=1,
    ),
    "llama": Family(
        arch="llama",
        renderer="llama-3",
        special=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
            "<|finetune_right_pad_id|>",
        ),  # fmt: skip
        added=(),
        eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>",
        stops=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
        template=LLAMA_TEMPLATE,
        digits=3,
        bos="<|begin_of_text|>",
    ),
}


def corpus(family: Family, tasks_per_env: int = 150) -> list[str]:
    """The tokenizer's training text, generated: every built-in env's opening messages
    and answers for its first ``tasks_per_env`` train tasks, its tool schemas, and each
    template rendered over a few conversations (so role names, headers and JSON merge)."""
    from jinja2 import Environment as Jinja

    from roles.lib.envs.builtin import BUILTINS

    texts: list[str] = []
    for name in sorted(BUILTINS):
        env = BUILTINS[name]()
        texts += [json.dumps(t) for t in env.tools]
        for i in range(min(tasks_per_env, env.size("train"))):
            task = env.task("train", i)
            chat = env.demonstration(task) or env.initial_messages(task)
            texts += [str(m.get("content") or "") for m in chat]
    rng = random.Random(0)
    scaffold = Jinja().from_string(
        family.template.replace("| tojson(indent=4)", "| string").replace("| tojson", "| string")
    )
    for _ in range(50):
        words = rng.sample(texts, 3)
        chat = [{"role": "system", "content": words[0]}, {"role": "user", "content": words[1]},
                {"role": "assistant", "content": words[2]}]  # fmt: skip
        texts.append(scaffold.render(messages=chat, tools=None, bos_token="",
                                     add_generation_prompt=True))  # fmt: skip
    return texts


def train_tokenizer(family: Family, vocab_size: int) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with the family's tokens and template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(family.split_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(family.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(corpus(family), trainer=trainer)
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=family.eos,
        pad_token=family.pad,
        bos_token=family.bos,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    tokenizer.chat_template = family.template
    return tokenizer


def kv_heads(num_heads: int) -> int:
    """Key/value heads of a family model built here: two query heads per key/value head."""
    return max(1, num_heads // 2)


def model_config(
    family: Family,
    tokenizer: Any,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
) -> Any:
    """The family's transformers config over ``tokenizer``'s vocabulary: grouped-query
    attention (two query heads per key/value head), tied embeddings."""
    from transformers import AutoConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (*family.special, family.eos)}
    return AutoConfig.for_model(
        family.arch,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=kv_heads(num_heads),
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=ids.get(family.bos) if family.bos else None,
        eos_token_id=ids[family.eos],
        pad_token_id=ids[family.pad],
    )


def build_family_model(
    out_dir: str | Path, arch: str, *, size: str = "tiny", seed: int = 0, **shape: Any
) -> Path:
    """Write a ``arch`` model (random weights from ``seed``) with its BPE tokenizer and
    chat template under ``out_dir``, in Hugging Face layout; its shape is ``SIZES[size]``
    with ``shape``'s keys (a run's ``model.tiny``) over it (None: the size's)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from roles.lib.model.tiny import save_pretrained

    if arch not in FAMILIES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    family = FAMILIES[arch]
    sizes = {**SIZES[size], **{k: v for k, v in shape.items() if v is not None}}
    tokenizer = train_tokenizer(family, sizes.pop("vocab_size"))
    config = model_config(family, tokenizer, **sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in family.stops],
        pad_token_id=config.pad_token_id,
    )
    out = Path(out_dir)
    save_pretrained(model.eval(), tokenizer, out)
    return out
