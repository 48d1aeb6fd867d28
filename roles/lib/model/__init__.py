"""Model library shared by the inference and trainer roles (not a role itself).

- `tokenizer`: the character tokenizer and chat template of the tiny model
- `tiny`: build the tiny Llama-style model from a seed (`rlbus model init`)
- `loading`: load any model/tokenizer directory with no network
- `weights`: weights <-> deterministic safetensors bytes with a sha256 digest
- `render`: token-in/token-out chat rendering for multi-turn episodes

Submodules import torch/transformers; import them directly (this package imports
nothing, so `import roles.lib.model` stays cheap).
"""
