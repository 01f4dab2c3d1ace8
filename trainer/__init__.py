"""The train partition: FSDP2 sharding, optimizer and schedule, the GRPO train step, weight publication to the
rollout ranks, and DCP checkpoints / HF export. Losses and advantages live in `rl/`."""
from trainer.trainer import Trainer

__all__ = ["Trainer"]
