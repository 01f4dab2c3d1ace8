"""Paged-KV decode engine (PagedAttention, Kwon et al. 2023, as in vLLM / nano-vllm): sequences, block manager,
scheduler, runner, sampler. Generic: requests of token ids in, tokens with logprobs and weight versions out."""
from engine.config import EngineConfig
from engine.engine import LLMEngine, StepStats
from engine.sampling import SamplingParams
from engine.scheduler import EngineStats
from engine.sequence import GenRequest, KVState, RequestOutput, UnfinishedRequest

__all__ = ["EngineConfig", "LLMEngine", "StepStats", "SamplingParams", "EngineStats", "GenRequest", "RequestOutput",
           "UnfinishedRequest", "KVState"]
