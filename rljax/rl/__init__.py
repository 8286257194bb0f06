"""RL: trajectory schema, advantages, losses, learner."""
