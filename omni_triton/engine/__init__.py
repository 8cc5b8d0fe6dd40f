"""One vLLM-style AR engine for the thinker and the talker (paged KV, chunked prefill, preemption, prefix
caching)."""

from omni_triton.engine.engine import EngineConfig, EngineLoop, EngineStats, LLMEngine, RequestOutput, RequestStream
from omni_triton.engine.sampling import SamplingParams
from omni_triton.engine.sequence import Sequence, SequenceStatus
from omni_triton.engine.stage import StageModel, TalkerStage, ThinkerStage

__all__ = ["EngineConfig", "EngineLoop", "EngineStats", "LLMEngine", "RequestOutput", "RequestStream",
           "SamplingParams", "Sequence", "SequenceStatus", "StageModel", "TalkerStage", "ThinkerStage"]
