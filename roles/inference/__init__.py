"""The inference role: answers generate/score requests for one model over core NATS.

- `backend`: the `Backend` contract (generate, score, load_weights, policy_version)
- `sampling`: temperature/top-k/top-p with per-request seeded generators (pure)
- `batcher`: gathers concurrent requests into static batches run in a worker thread
- `continuous`: the continuous batcher (requests join a running decode loop);
  `kv_cache`: merging, selecting and trimming the rows of its KV cache
- `torch_backend`: transformers/torch engine (CPU, or one GPU) behind either batcher
- `vllm_backend`: the same contract on vLLM (optional `vllm` extra, GPU)
- `role`: `rlbus role inference --run R [--model policy]` (serves, follows weights)

This package imports nothing: torch loads only when a submodule is imported.
"""
