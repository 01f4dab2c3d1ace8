"""RL pieces that are neither model nor engine: data, rewards, tasks, losses, advantages, shared types."""
