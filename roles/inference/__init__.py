"""The inference role: answers generate/score requests for one model over core NATS.

- `backend`: the `Backend` contract (generate, score, load_weights, policy_version) and
  the rules every backend keeps (request checks, finite weights, throughput metrics)
- `sampling`: temperature/top-k/top-p for all rows at once, counter-based per-request
  randomness (pure)
- `model_runner`: the decoder forward over a preallocated slot KV cache (Llama family)
- `slots`: which request holds which KV slot, and where a prompt's prefix already is
- `engine`: the torch engine: admission, prefix sharing, the fixed decode step (a CUDA
  graph on the GPU), stops, scores, weight swaps
- `torch_backend`: the async `Backend` over the engine (its decode loop in a worker thread)
- `vllm_backend`: the same contract on vLLM (optional `vllm` extra, GPU)
- `role`: `rlbus role inference --run R [--model policy]` (serves, follows weights)
- `pinning`: eval pinning (a swap held back for requests pinned to a version) and snapshots
- `weights_io`: where published weights come from (the newest announcement, its bytes,
  retries of transient fetch failures)
- `capacity`: which models the torch engine runs, in which dtype, how many KV rows fit
  (no torch: `rlbus up`'s preflight applies the engine's rules)
- `torch_setup`: process setup for the torch engine (threads, CUDA memory share, default
  stop tokens)

This package imports nothing: torch loads only when a submodule is imported.
"""
