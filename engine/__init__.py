"""Paged-KV decode engine: sequences, block manager, scheduler, runner, sampler (see DESIGN.md, "Engine")."""
from engine.config import EngineConfig
from engine.engine import LLMEngine, StepStats
from engine.sampling import SamplingParams
from engine.scheduler import EngineStats
from engine.sequence import GenRequest, RequestOutput, UnfinishedRequest

__all__ = ["EngineConfig", "LLMEngine", "StepStats", "SamplingParams", "EngineStats", "GenRequest", "RequestOutput",
           "UnfinishedRequest"]
