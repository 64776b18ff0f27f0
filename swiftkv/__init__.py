"""SwiftKV: later layers' KV computed from one earlier layer's output, so prompt tokens skip those layers.

Importing the package registers the ``llama_swiftkv`` / ``qwen2_swiftkv`` / ``qwen3_swiftkv`` model types with transformers'
Auto classes, so ``AutoModelForCausalLM.from_pretrained(dir)`` (and ``AutoModel``, the decoder without its head, which
e.g. a ranker reading x_l loads) works without ``trust_remote_code``.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from toolkit import __version__  # noqa: F401  (re-exported as swiftkv.__version__)

from .configuration_swiftkv import LlamaSwiftKVConfig, Qwen2SwiftKVConfig, Qwen3SwiftKVConfig
from .modeling_swiftkv import (
    LlamaSwiftKVForCausalLM,
    LlamaSwiftKVModel,
    Qwen2SwiftKVForCausalLM,
    Qwen2SwiftKVModel,
    Qwen3SwiftKVForCausalLM,
    Qwen3SwiftKVModel,
)

for _config, _decoder, _model in (
    (LlamaSwiftKVConfig, LlamaSwiftKVModel, LlamaSwiftKVForCausalLM),
    (Qwen2SwiftKVConfig, Qwen2SwiftKVModel, Qwen2SwiftKVForCausalLM),
    (Qwen3SwiftKVConfig, Qwen3SwiftKVModel, Qwen3SwiftKVForCausalLM),
):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _decoder, exist_ok=True)
    AutoModelForCausalLM.register(_config, _model, exist_ok=True)

__all__ = [
    "LlamaSwiftKVConfig",
    "LlamaSwiftKVForCausalLM",
    "Qwen2SwiftKVConfig",
    "Qwen2SwiftKVForCausalLM",
    "Qwen3SwiftKVConfig",
    "Qwen3SwiftKVForCausalLM",
]
