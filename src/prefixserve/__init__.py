"""prefixserve: an LLM serving engine that stores each shared prefix once and reads it once per step."""

from .config import CacheConfig, EngineConfig, SchedulerConfig
from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "CacheConfig", "SchedulerConfig"]
__version__ = "0.1.0"
