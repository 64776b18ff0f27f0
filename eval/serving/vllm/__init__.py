"""vLLM plugin that serves SwiftKV checkpoints with real prefill skipping.

vLLM runs ``register()`` in every one of its processes through the ``vllm.general_plugins`` entry point of
this distribution.  It registers the ``*_swiftkv`` config classes with transformers' AutoConfig, the SwiftKV
model classes with vLLM's ModelRegistry (by import string, so the model module loads only when a SwiftKV
checkpoint is served), and a config hook that turns on vLLM's ``kv_sharing_fast_prefill`` for SwiftKV
checkpoints: that is what lets only the rows that need logits continue through layers >= l.

Importing this package imports neither vLLM nor torch; ``register()`` does, when vLLM calls it.
"""

from __future__ import annotations

MODEL_CLASSES = {
    "LlamaSwiftKVForCausalLM": "eval.serving.vllm.llama:LlamaSwiftKVForCausalLM",
    "Qwen2SwiftKVForCausalLM": "eval.serving.vllm.llama:Qwen2SwiftKVForCausalLM",
    "Qwen3SwiftKVForCausalLM": "eval.serving.vllm.llama:Qwen3SwiftKVForCausalLM",
}


def fast_prefill_applies(hf_config) -> bool:
    """Whether a checkpoint config runs the SwiftKV path with at least one SwiftKV layer."""
    return bool(getattr(hf_config, "swiftkv", False)) and (
        hf_config.num_key_value_layers < hf_config.num_hidden_layers
    )


class SwiftKVConfigHook:
    """vLLM per-architecture config hook (``MODELS_CONFIG_MAP``): SwiftKV checkpoints get
    ``kv_sharing_fast_prefill`` so vLLM builds attention metadata for the logits rows of layers >= l."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        return None

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        if not fast_prefill_applies(vllm_config.model_config.hf_config):
            return
        spec = vllm_config.speculative_config
        if spec is not None and spec.use_eagle():
            return  # EAGLE needs hidden states of every prompt token; SwiftKV then runs without skipping
        vllm_config.cache_config.kv_sharing_fast_prefill = True


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make vLLM load ``llama/qwen2/qwen3_swiftkv`` checkpoints."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from swiftkv.configuration_swiftkv import LlamaSwiftKVConfig, Qwen2SwiftKVConfig, Qwen3SwiftKVConfig

    for config_class in (LlamaSwiftKVConfig, Qwen2SwiftKVConfig, Qwen3SwiftKVConfig):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    for arch, target in MODEL_CLASSES.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, target)
        MODELS_CONFIG_MAP.setdefault(arch, SwiftKVConfigHook)
