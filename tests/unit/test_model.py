"""Unit tests for roles.lib.model: tokenizer, tiny model build/load, weights as bytes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from roles.lib.model import ensure_tiny_model
from roles.lib.model.loading import ModelNotFound, load_model, load_tokenizer
from roles.lib.model.tiny import build_tiny_model, count_params, init_model
from roles.lib.model.tokenizer import ALPHABET, build_tokenizer
from roles.lib.model.weights import (
    WeightsDigestMismatch,
    bytes_to_state_dict,
    digest,
    load_state_bytes,
    state_dict_to_bytes,
)

TOKENIZER = build_tokenizer()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def _sha256_tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=ALPHABET))
def test_tokenizer_round_trip_one_token_per_char(s: str) -> None:
    """decode(encode(s)) == s for any alphabet string, with one token per plain char."""
    ids = TOKENIZER.encode(s, add_special_tokens=False)
    assert TOKENIZER.decode(ids) == s
    assert TOKENIZER.unk_token_id not in ids
    # A special-token string such as "<|bos|>" inside the text is one token (HF behaviour).
    if "<|" not in s:
        assert len(ids) == len(s)


def test_tokenizer_special_ids_and_unknown_chars() -> None:
    """pad is id 0 and a character outside the alphabet maps to <|unk|>."""
    assert TOKENIZER.pad_token_id == 0
    assert TOKENIZER.convert_ids_to_tokens([0, 1, 2, 3]) == [
        "<|pad|>",
        "<|bos|>",
        "<|eos|>",
        "<|unk|>",
    ]
    assert TOKENIZER.encode("a\u00e9", add_special_tokens=False)[1] == TOKENIZER.unk_token_id


def test_chat_template_renders_expected_string_and_ids() -> None:
    """The chat template writes <|role|>content<|end|> per message (tool: name prefix)."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "tool", "name": "calc", "content": "4"},
    ]
    text = TOKENIZER.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|system|>Be brief.<|end|><|user|>2+2?<|end|><|assistant|>4<|end|>"
        "<|tool|>calc:4<|end|><|assistant|>"
    )
    no_gp = TOKENIZER.apply_chat_template(messages[:2], tokenize=False)
    assert no_gp == "<|system|>Be brief.<|end|><|user|>2+2?<|end|>"

    tid = TOKENIZER.convert_tokens_to_ids
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    assert ids[:2] == [tid("<|system|>"), tid("B")]
    assert ids[-2:] == [tid("<|end|>"), tid("<|assistant|>")]
    assert ids.count(tid("<|end|>")) == 4
    assert len(ids) == len("Be brief.2+2?4calc:4") + 4 + 4 + 1


def test_tiny_model_build_is_byte_identical(tmp_path: Path) -> None:
    """Two builds from the same seed write byte-identical files; another seed differs."""
    a = _sha256_tree(build_tiny_model(tmp_path / "a", seed=7))
    b = _sha256_tree(build_tiny_model(tmp_path / "b", seed=7))
    c = _sha256_tree(build_tiny_model(tmp_path / "c", seed=8))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(a)
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]


def test_tiny_model_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    """Building the model does not consume or reseed the global torch RNG."""
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_tiny_model_loads_through_auto_classes(tiny_dir: Path) -> None:
    """The saved directory loads with AutoModelForCausalLM/AutoTokenizer, offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    assert model.config.vocab_size == len(tokenizer) == len(TOKENIZER)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tokenizer.chat_template == TOKENIZER.chat_template
    s = "Hi there,\n  (x) = `y`!"
    assert tokenizer.decode(tokenizer.encode(s, add_special_tokens=False)) == s
    assert model.generation_config.eos_token_id == [
        tokenizer.convert_tokens_to_ids("<|end|>"),
        tokenizer.eos_token_id,
    ]


def test_param_count_in_range(tmp_path: Path) -> None:
    """Default sizes give a CPU-friendly model (0.2-5 M params) sized to the vocab."""
    summary = init_model(tmp_path / "m", seed=0)
    assert 200_000 <= summary["params"] <= 5_000_000
    assert summary["vocab_size"] == len(TOKENIZER)
    assert summary["weights_digest"].startswith("sha256:")
    assert count_params(load_model(tmp_path / "m")) == summary["params"]


def test_load_missing_path_raises_model_not_found(tmp_path: Path) -> None:
    """A path that does not exist is a ModelNotFound naming the path, not a download."""
    missing = tmp_path / "nope"
    with pytest.raises(ModelNotFound, match="nope"):
        load_model(missing)
    with pytest.raises(ModelNotFound, match="nope"):
        load_tokenizer(missing)


def test_ensure_tiny_model_builds_once(tmp_path: Path) -> None:
    """ensure_tiny_model builds under <run>/model/initial and reuses it afterwards."""
    path = ensure_tiny_model(tmp_path, {"num_layers": 1}, seed=3)
    assert path == tmp_path / "model" / "initial"
    before = _sha256_tree(path)
    assert ensure_tiny_model(tmp_path, {"num_layers": 1}, seed=3) == path
    assert _sha256_tree(path) == before
    assert load_model(path).config.num_hidden_layers == 1


def test_a_tiny_model_is_built_once_per_machine_and_copied_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next run asking for the same tiny model gets the bytes a build writes, copied
    from the cache without importing torch; another seed is another build."""
    sizes = {"num_layers": 1}
    monkeypatch.setenv("RLBUS_CACHE_DIR", str(tmp_path / "cache"))
    first = ensure_tiny_model(tmp_path / "a", sizes, seed=3)
    assert len(list((tmp_path / "cache" / "models").iterdir())) == 1
    code = (
        "import sys; from roles.lib.model import ensure_tiny_model; "
        "ensure_tiny_model(sys.argv[1], {'num_layers': 1}, seed=3); print('torch' in sys.modules)"
    )
    copied = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "b")],
        capture_output=True, text=True, env=dict(os.environ), check=True,
    )  # fmt: skip
    assert copied.stdout.strip() == "False", copied.stderr
    assert _sha256_tree(tmp_path / "b" / "model" / "initial") == _sha256_tree(first)

    monkeypatch.setenv("RLBUS_CACHE_DIR", str(tmp_path / "empty"))  # a build, not a copy
    assert _sha256_tree(ensure_tiny_model(tmp_path / "c", sizes, seed=3)) == _sha256_tree(first)
    other = ensure_tiny_model(tmp_path / "d", sizes, seed=4)
    assert _sha256_tree(other) != _sha256_tree(first)
    assert len(list((tmp_path / "empty" / "models").iterdir())) == 2


def test_weights_bytes_round_trip_identical_logits(tiny_dir: Path, tmp_path: Path) -> None:
    """Weights sent as bytes reproduce the sender's logits exactly and keep tying."""
    sender = load_model(tiny_dir)
    receiver = load_model(build_tiny_model(tmp_path / "other", seed=1))
    ids = torch.tensor([TOKENIZER.encode("Hello, world!", add_special_tokens=False)])

    b = state_dict_to_bytes(sender)
    assert "lm_head.weight" not in bytes_to_state_dict(b)  # tied copy is not sent
    assert state_dict_to_bytes(sender) == b  # deterministic
    load_state_bytes(receiver, b, digest(b))

    assert receiver.lm_head.weight is receiver.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(receiver(ids).logits, sender(ids).logits)
    assert state_dict_to_bytes(receiver) == b


def test_tampered_weights_raise_digest_mismatch(tiny_dir: Path) -> None:
    """One flipped byte is caught by the digest before the model is touched."""
    model = load_model(tiny_dir)
    b = state_dict_to_bytes(model)
    tampered = b[:-1] + bytes([b[-1] ^ 0xFF])
    before = state_dict_to_bytes(model)
    with pytest.raises(WeightsDigestMismatch) as info:
        load_state_bytes(model, tampered, digest(b))
    assert info.value.expected == digest(b)
    assert info.value.actual == digest(tampered)
    assert state_dict_to_bytes(model) == before


def test_a_token_added_later_moves_no_initial_weight() -> None:
    """The tiny model over the grown vocabulary has exactly the weights the first
    vocabulary's model had (same seed), plus the added tokens' rows at the mean
    embedding: a new special token never changes a run's starting point."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from roles.lib.model.tiny import BASE_VOCAB, init_weights, tiny_config
    from roles.lib.model.tokenizer import build_tokenizer

    cfg = tiny_config(build_tokenizer())
    assert cfg.vocab_size > BASE_VOCAB
    grown = dict(init_weights(cfg, 3).named_parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        first = LlamaForCausalLM(LlamaConfig(**{**cfg.to_dict(), "vocab_size": BASE_VOCAB}))
    for name, w in first.named_parameters():
        assert torch.equal(grown[name][: len(w)], w), name
    emb = grown["model.embed_tokens.weight"]
    assert torch.allclose(emb[BASE_VOCAB:], emb[:BASE_VOCAB].mean(0).expand_as(emb[BASE_VOCAB:]))


def test_auto_device_and_a_tokenizer_need_no_torch_without_a_gpu_driver(tiny_dir: Path) -> None:
    """ "auto" is cpu without asking torch where no GPU driver is (this machine), and the
    same as torch's answer where one is; the tiny model's tokenizer loads, as
    ``AutoTokenizer`` builds it, without importing torch (env servers and the teacher
    start seconds sooner)."""
    from transformers import AutoTokenizer

    from roles.lib.model import loading

    probe = (
        "import sys; from roles.lib.model.loading import gpu_driver_present, resolve_device, "
        f"load_tokenizer; load_tokenizer({str(tiny_dir)!r}); "
        "print(gpu_driver_present(), resolve_device('auto'), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    driver, device, torch_loaded = out.stdout.split()
    if driver == "False":
        assert (device, torch_loaded) == ("cpu", "False")
    assert loading.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    auto, fast = AutoTokenizer.from_pretrained(tiny_dir), loading.load_tokenizer(tiny_dir)
    assert type(auto) is type(fast) and auto.chat_template == fast.chat_template
    assert auto("reverse: abc<|im_end|>").input_ids == fast("reverse: abc<|im_end|>").input_ids
