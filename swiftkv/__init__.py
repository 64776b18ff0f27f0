"""SwiftKV: later layers' KV computed from one earlier layer's output, so prompt tokens skip those layers.

Importing the package registers the ``llama_swiftkv`` / ``qwen2_swiftkv`` / ``qwen3_swiftkv`` model types with transformers'
Auto classes, so ``AutoModelForCausalLM.from_pretrained(dir)`` works without ``trust_remote_code``.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration_swiftkv import LlamaSwiftKVConfig, Qwen2SwiftKVConfig, Qwen3SwiftKVConfig
from .modeling_swiftkv import (
    LlamaSwiftKVForCausalLM,
    Qwen2SwiftKVForCausalLM,
    Qwen3SwiftKVForCausalLM,
)

__version__ = "0.1.0"

for _config, _model in (
    (LlamaSwiftKVConfig, LlamaSwiftKVForCausalLM),
    (Qwen2SwiftKVConfig, Qwen2SwiftKVForCausalLM),
    (Qwen3SwiftKVConfig, Qwen3SwiftKVForCausalLM),
):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModelForCausalLM.register(_config, _model, exist_ok=True)

__all__ = [
    "LlamaSwiftKVConfig",
    "LlamaSwiftKVForCausalLM",
    "Qwen2SwiftKVConfig",
    "Qwen2SwiftKVForCausalLM",
    "Qwen3SwiftKVConfig",
    "Qwen3SwiftKVForCausalLM",
]
