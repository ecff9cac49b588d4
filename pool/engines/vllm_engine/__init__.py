"""The vLLM engine backend (issue 7): `VllmEngine` implements `pool.engines.base.Engine` on vLLM.

Importing this package does not import vllm; starting an engine does.
"""

from pool.engines.vllm_engine.config import VllmEngineConfig
from pool.engines.vllm_engine.engine import VllmEngine, make_vllm_engine

__all__ = ["VllmEngine", "VllmEngineConfig", "make_vllm_engine"]
