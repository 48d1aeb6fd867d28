"""LoRA: low-rank adapters trained with peft, merged into the base weights where they serve.

With ``[trainer.lora]`` (rank, alpha, dropout, target_modules) the trainer wraps its model
with peft (``wrap``): the base weights are frozen, only each adapted linear layer's
``A`` (rank x in) and ``B`` (out x rank) train, and the modules named in
``modules_to_save`` whole (e.g. the embeddings), and AdamW holds moments for those alone.
What the trainer checkpoints and publishes is the adapters (``adapter_state``, named by
the Hugging Face module they adapt: ``model.layers.0.self_attn.q_proj.lora_A``), as
safetensors bytes that say so in their metadata (``roles.lib.model.weights``): every
path that carries weights (object store, file, shm, checkpoints, replay's digests)
carries them unchanged, at a fraction of the model's size.

Where weights serve (inference, a reference snapshot, ``rlbus eval --checkpoint``,
``rlbus model export``) the adapter is merged: ``W = W_base + alpha / rank x B @ A``,
in fp32 and cast to the weight's dtype (``merge``), always from the base weights, never
onto the previous version's merged ones (no drift over a run). A serving model keeps a
copy of the base weights of the adapted layers the first time an adapter reaches it
(``base_weights``; the weights trained whole are loaded as they are): in a LoRA run version 0 is the base model and every later version is
an adapter, so the model holds the base then.

Peft initialises ``B`` to zero (a fresh adapter is the base model exactly) and ``A`` at
random; ``wrap`` draws ``A`` from a seed of its own, so a restarted trainer and a replay
start from the same adapters.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from configs.models import LoraConfig, lora_targets_problem

# Adapter tensor names end in these (after the adapted module's path).
A_SUFFIX, B_SUFFIX = ".lora_A", ".lora_B"
# peft's names: base_model.model.<module>.lora_A.default.weight
_PEFT_PREFIX = "base_model.model."
_ADAPTER = "default"


def wrap(model: torch.nn.Module, lora: LoraConfig, seed: int) -> Any:
    """``model`` with peft LoRA adapters on ``lora.target_modules`` (only they train, and
    the modules of ``lora.modules_to_save``, whole); the adapters' random init drawn
    from ``seed`` alone."""
    from peft import LoraConfig as PeftLoraConfig  # the trainer's only peft import
    from peft import get_peft_model

    problem = lora_targets_problem(lora, linear_layers(model), module_names(model))
    if problem is not None:
        raise ValueError(problem)
    config = PeftLoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules), init_lora_weights=True, bias="none",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    # Trained whole, in place (not peft's modules_to_save, which trains a copy and so
    # would untie an output layer tied to the embeddings: the served model could not
    # hold what was trained).
    for name, module in peft_model.get_base_model().named_modules():
        if name.rsplit(".", 1)[-1] in lora.modules_to_save:
            for p in module.parameters():
                p.requires_grad_(True)
    return peft_model


def linear_layers(model: torch.nn.Module) -> set[str]:
    """The names (last part of the path) of the linear layers LoRA may adapt: all but
    those whose weight is tied to another module's (an output layer tied to the
    embeddings: a merged delta would change the embeddings too; train the embeddings
    whole with ``modules_to_save`` instead)."""
    holders: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        holders[id(p)] = holders.get(id(p), 0) + 1
    return {
        n.rsplit(".", 1)[-1]
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and holders.get(id(m.weight), 0) == 1
    }


def module_names(model: torch.nn.Module) -> set[str]:
    """The names (last part of the path) of a model's modules that hold parameters."""
    return {
        n.rsplit(".", 1)[-1]
        for n, m in model.named_modules()
        if n and any(True for _ in m.parameters(recurse=False))
    }


def scale(alpha: float, rank: int) -> float:
    """The factor of ``B @ A`` in the merged weight (peft's ``lora_alpha / r``)."""
    return alpha / rank


def _our_name(peft_name: str) -> str:
    """A trained parameter's name in adapter states: ``base_model.model.<m>.lora_A.default
    .weight`` -> ``<m>.lora_A``; a module trained whole: its Hugging Face name."""
    name = peft_name.removeprefix(_PEFT_PREFIX)
    for suffix in (A_SUFFIX, B_SUFFIX):
        tail = f"{suffix}.{_ADAPTER}.weight"
        if name.endswith(tail):
            return name[: -len(tail)] + suffix
    return name


def _trained(peft_model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every parameter the optimizer steps, by adapter-state name (a tied one once)."""
    return {_our_name(n): p for n, p in peft_model.named_parameters() if p.requires_grad}


def adapter_state(peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a LoRA trainer publishes: the adapters by module name (``<module>.lora_A`` /
    ``.lora_B``) and the modules trained whole (``modules_to_save``) by weight name."""
    return {name: p.detach() for name, p in _trained(peft_model).items()}


def load_adapter_state(peft_model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (``adapter_state``'s names) into the peft model's trained
    parameters; the same names and shapes exactly, else ValueError (a checkpoint of
    another LoRA)."""
    params = _trained(peft_model)
    if set(params) != set(tensors):
        missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise ValueError(
            f"adapters do not match trainer.lora: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            if p.shape != tensors[name].shape:
                raise ValueError(f"adapter {name}: shape {tuple(tensors[name].shape)}, "
                                 f"trainer.lora makes {tuple(p.shape)}")  # fmt: skip
            p.copy_(tensors[name])


def adapted_modules(adapters: dict[str, torch.Tensor]) -> list[str]:
    """The modules an adapter state adapts, sorted."""
    return sorted(n[: -len(A_SUFFIX)] for n in adapters if n.endswith(A_SUFFIX))


def merge(
    base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], factor: float
) -> dict[str, torch.Tensor]:
    """The merged ``<module>.weight`` of each adapted module: ``base + factor x B @ A``
    in fp32, in the base weight's dtype and device; and the weights trained whole as
    they are. ``base`` holds at least the adapted weights; an adapter for a module it
    lacks, or of the wrong shape, is a ValueError."""
    modules = adapted_modules(adapters)
    lora_tensors = [n for n in adapters if n.endswith((A_SUFFIX, B_SUFFIX))]
    if len(lora_tensors) != 2 * len(modules):
        raise ValueError("an adapter state holds each adapted module's lora_A and lora_B")
    out = {n: t for n, t in adapters.items() if not n.endswith((A_SUFFIX, B_SUFFIX))}
    for module in modules:
        key = f"{module}.weight"
        a, b = adapters.get(module + A_SUFFIX), adapters.get(module + B_SUFFIX)
        w = base.get(key)
        if w is None or a is None or b is None:
            raise ValueError(
                f"adapter for {module!r}: the model has no {key} (or the first adapter that "
                "reached it did not adapt it), or the adapter lacks its lora_A or lora_B"
            )
        if (
            a.dim() != 2
            or b.dim() != 2
            or (b.shape[0], a.shape[1]) != tuple(w.shape)
            or (a.shape[0] != b.shape[1])
        ):
            raise ValueError(
                f"adapter for {module!r}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit "
                f"its weight {tuple(w.shape)}"
            )
        delta = b.to(w.device, torch.float32) @ a.to(w.device, torch.float32)
        out[key] = (w.to(torch.float32) + factor * delta).to(w.dtype)
    return out


_bases: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)
_bases_lock = threading.Lock()


def base_weights(model: torch.nn.Module, keys: list[str]) -> dict[str, torch.Tensor]:
    """The base weights ``keys`` of a serving ``model``: copied the first time an
    adapter reaches it (the model holds the base then, see the module docstring),
    then always that copy. Later adapters must adapt the same layers."""
    with _bases_lock:
        kept = _bases.get(model)
        if kept is None:
            own = model.state_dict()
            kept = {k: own[k].detach().clone() for k in keys if k in own}
            _bases[model] = kept
    return kept  # (a key missing here is ``merge``'s error to name)
