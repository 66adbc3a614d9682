"""Policy and drafter networks: architecture, KV cache, checkpoint loading. Nothing about sampling or RL."""
