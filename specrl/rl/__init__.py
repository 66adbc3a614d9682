"""The learning side: advantages, policy losses and the learner (knows nothing about rollouts)."""
