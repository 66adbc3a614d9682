"""specrl: RL post-training with lossless speculative rollouts."""
