"""The train partition: FSDP2 sharding, optimizer and schedule, the GRPO train step, weight publication to the
rollout ranks, and DCP checkpoints / HF export. Losses and advantages live in `rl/`."""
from typing import Any

__all__ = ["Trainer"]


def __getattr__(name: str) -> Any:
    """`Trainer` on first use: a rollout rank imports trainer.publish / trainer.checkpoint (weights in, run directory)
    but never the train step, FSDP2 or DCP (~1.5 s of its start-up)."""
    if name == "Trainer":
        from trainer.trainer import Trainer
        return Trainer
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
