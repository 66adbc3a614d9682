"""Policy and drafter networks: architecture, KV cache, checkpoints. No sampling, no RL."""
