"""A tiny Llama-style model for CPU runs and tests, built from a seed.

The model is sized to the character tokenizer (`roles.lib.model.tokenizer`) and saved as an
ordinary Hugging Face model directory (safetensors weights, config, generation config,
tokenizer), so every role loads it with `AutoModelForCausalLM.from_pretrained` exactly as
it would load a real model. Same seed and sizes => byte-identical files.

    python -c "from roles.lib.model.tiny import init_model; print(init_model('/tmp/tiny', 0))"

(`rlbus model init` wraps `init_model`.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from roles.lib.model.tokenizer import ALPHABET, END, SPECIAL_TOKENS, build_tokenizer
from roles.lib.model.weights import digest, state_dict_to_bytes

# The char tokenizer's first vocabulary: the tiny model's random draws are over these.
BASE_VOCAB = len(SPECIAL_TOKENS) + len(ALPHABET)


def tiny_config(
    tokenizer: Any,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_position_embeddings: int = 256,
) -> LlamaConfig:
    """The LlamaConfig of the tiny model over ``tokenizer``'s vocabulary and special
    tokens (tied embeddings, plain multi-head attention)."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def init_weights(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """A freshly initialised model; the seed alone fixes every weight.

    The tokens added to the char tokenizer after its first vocabulary
    (``LATER_SPECIAL_TOKENS``, e.g. ``<|tool_call|>``) do not move a single random draw:
    the model is drawn over the first ``BASE_VOCAB`` tokens exactly as before, then each
    added token's embedding (tied to its output row) is the mean of the others. So a
    seed gives the same initial weights it always gave (a run's results stay
    comparable), and a new token starts as an average token, not a random one.

    fork_rng restores the global RNG afterwards, so building a model never perturbs the
    caller's random stream (devices=[] because the model is built on the CPU).
    """
    base = min(config.vocab_size, BASE_VOCAB)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "vocab_size": base}))
        if config.vocab_size > base:  # (resizing draws rows we overwrite: inside fork_rng)
            weight: torch.Tensor = model.get_input_embeddings().weight  # type: ignore[assignment]
            old = weight.detach().clone()
            model.resize_token_embeddings(config.vocab_size, mean_resizing=False)
            added = old.mean(0, keepdim=True).expand(config.vocab_size - base, -1)
            resized: torch.Tensor = model.get_input_embeddings().weight  # type: ignore[assignment]
            with torch.no_grad():
                resized.copy_(torch.cat([old, added]))
            model.tie_weights()
    return model.eval()


def build_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_position_embeddings: int = 256,
    seed: int = 0,
) -> Path:
    """Build the tiny model from `seed` and save model + tokenizer under `out_dir`."""
    out = Path(out_dir)
    tokenizer = build_tokenizer()
    config = tiny_config(
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
    )
    model = init_weights(config, seed)
    # Both <|end|> (end of an assistant turn) and eos stop generation.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(END), tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    save_pretrained(model, tokenizer, out)
    return out


def save_pretrained(model: Any, tokenizer: Any, out: Path) -> None:
    """Model and tokenizer in Hugging Face layout under `out`, every file with one mode.

    safetensors (0.8) writes `model.safetensors` to a temporary file, created 0600, and
    renames it into place, so the weights alone would be readable by their owner only
    (another user's inference, a container running as non-root). They get the mode the
    umask gave `config.json`, written by a plain `open` beside them.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a progress bar per tiny file is noise in role logs
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    mode = (out / "config.json").stat().st_mode & 0o777
    for weights in out.glob("*.safetensors"):
        weights.chmod(mode)


def count_params(model: torch.nn.Module) -> int:
    """Distinct parameters (the tied lm_head is counted once)."""
    return sum(p.numel() for p in model.parameters())


def init_model(out_dir: str | Path, seed: int = 0, **sizes: Any) -> dict[str, Any]:
    """Build the tiny model and summarise it (the body of `rlbus model init`).

    The digest is of `state_dict_to_bytes`, i.e. the same digest the trainer would
    publish for these weights, so version 0 of a run can be checked against it.
    """
    return summarize(build_tiny_model(out_dir, seed=seed, **sizes), seed)


def summarize(path: Path, seed: int) -> dict[str, Any]:
    """What ``rlbus model init`` prints of a built model: its path, seed, size and the
    digest of its weights."""
    from roles.lib.model.loading import load_model

    model = load_model(path)
    return {
        "path": str(path),
        "seed": seed,
        "params": count_params(model),
        "vocab_size": model.config.vocab_size,
        "weights_digest": digest(state_dict_to_bytes(model)),
    }
