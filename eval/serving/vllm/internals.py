"""Every vLLM name the SwiftKV plugin uses beyond vLLM's documented plugin API, in one place.

vLLM's model-side building blocks (layers, the compile decorators, the forward context, attention metadata) are
not a stable API: a minor release can move or rename them.  The plugin imports them from here only, and
``USED`` lists each one with the parameters or members the plugin relies on, so that a vLLM upgrade is checked
name by name: ``tests/eval/serving/vllm/test_plugin.py`` resolves every entry in the installed vLLM, and
``swiftkv check-vllm-api`` (``eval.serving.vllm.api_check``) reads another vLLM's Python sources (no import, so a
CUDA wheel can be checked on a CPU machine).  The tested range is stated in docs/serving.md.

Importing this module imports vLLM's model stack, so only the model module (``llama.py``) imports it.  The few
names the registration needs (``MODELS_CONFIG_MAP``, ``InputProcessor``, ``VLLMValidationError``) are imported
where they are used, inside ``register()``'s guard, and are listed in ``USED`` all the same.
"""

from __future__ import annotations

from vllm.compilation.backends import set_model_tag
from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled
from vllm.compilation.decorators import ignore_torch_compile, support_torch_compile
from vllm.config.compilation import CUDAGraphMode
from vllm.distributed.parallel_state import (
    get_pp_group,
    get_tensor_model_parallel_world_size,
)
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention.attention import (
    Attention,
    unified_attention_with_output,
    unified_kv_cache_update,
)
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)
from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer
from vllm.utils.torch_utils import _encode_layer_name
from vllm.v1.attention.backends import utils as fast_prefill_utils
from vllm.v1.attention.backends.utils import KVSharingFastPrefillMetadata
from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1ModelRunner

encode_layer_name = _encode_layer_name  # public name inside the plugin

# "module:qualname" -> the parameters (for a function), or the parameters, fields, attributes and methods (for a
# class) that the plugin passes or reads.  Keep it in step with the imports above and the plugin's uses.
USED: dict[str, tuple[str, ...]] = {
    "vllm.compilation.backends:set_model_tag": ("tag",),
    # VLLM_USE_BREAKABLE_CUDAGRAPH as vLLM reads it, after its config may have turned it on (fast_prefill_refusal)
    "vllm.compilation.breakable_cudagraph:is_breakable_cudagraph_enabled": (),
    "vllm.compilation.decorators:support_torch_compile": ("dynamic_arg_dims",),
    "vllm.compilation.decorators:ignore_torch_compile": ("cls",),
    "vllm.config.compilation:CUDAGraphMode": ("NONE", "PIECEWISE", "FULL", "has_piecewise_cudagraphs"),
    "vllm.config.compilation:CompilationConfig": (
        "cudagraph_mode",
        "cudagraph_capture_sizes",
        "mode",
        "adjust_cudagraph_sizes_for_spec_decode",  # why the capture sizes are read when used (layout.captured_sizes)
    ),
    "vllm.config.cache:CacheConfig": ("kv_sharing_fast_prefill",),
    "vllm.config.model:ModelConfig": ("hf_config", "runner_type", "architectures"),
    "vllm.config.speculative:SpeculativeConfig": (
        "use_eagle",
        "num_speculative_tokens",
        "enable_adaptive_verification",
    ),
    "vllm.config.parallel:ParallelConfig": (
        "use_ubatching",
        "decode_context_parallel_size",
        "prefill_context_parallel_size",
    ),
    "vllm.config.scheduler:SchedulerConfig": ("max_num_batched_tokens",),
    "vllm.distributed.parallel_state:get_pp_group": (),
    "vllm.distributed.parallel_state:get_tensor_model_parallel_world_size": (),
    "vllm.forward_context:get_forward_context": (),
    "vllm.forward_context:ForwardContext": (
        "attn_metadata",
        "batch_descriptor",
        "cudagraph_runtime_mode",
        "no_compile_layers",
        "slot_mapping",
    ),
    "vllm.forward_context:BatchDescriptor": ("num_tokens",),
    "vllm.model_executor.layers.attention.attention:Attention": (
        "num_heads",
        "head_size",
        "scale",
        "num_kv_heads",
        "cache_config",
        "quant_config",
        "prefix",
        "attn_type",
        "kv_sharing_target_layer_name",
        "layer_name",
        "use_direct_call",
        "attn_backend",
        "impl",
        "kv_cache",
        "query_quant",  # with its scale, the buffer ``_q_scale`` (registered by name: not checkable by source)
    ),  # fmt: skip
    # exact K/V quantize queries as Attention.forward does, where the backend takes FP8 queries
    "vllm.v1.attention.backend:AttentionImplBase": ("supports_quant_query_input",),
    "vllm.model_executor.layers.attention.attention:unified_kv_cache_update": ("key", "value", "layer_name"),
    "vllm.model_executor.layers.attention.attention:unified_attention_with_output": (
        "query",
        "key",
        "value",
        "output",
        "layer_name",
        "kv_cache_dummy_dep",
    ),
    # the exact K/V write calls the holder's backend as unified_kv_cache_update does (the GPU default and the CPU one)
    "vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.do_kv_cache_update": (
        "layer",
        "key",
        "value",
        "kv_cache",
        "slot_mapping",
    ),
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.do_kv_cache_update": (
        "layer",
        "key",
        "value",
        "kv_cache",
        "slot_mapping",
    ),
    # the fast-prefill builder (create_fast_prefill_custom_backend) calls this through the module: the prompt
    # window wraps it there and rewrites these fields of the metadata it gets
    "vllm.v1.attention.backends.utils:make_kv_sharing_fast_prefill_common_attn_metadata": (
        "common_attn_metadata",
    ),
    "vllm.v1.attention.backends.utils:create_fast_prefill_custom_backend": (
        "prefix",
        "underlying_attn_backend",
    ),
    "vllm.v1.attention.backend:CommonAttentionMetadata": (
        "query_start_loc_cpu",
        "max_query_len",
        "logits_indices_padded",
        "num_logits_indices",
        "max_logits_per_req",
        "seq_lens_cpu_upper_bound",  # the rows' positions (exact for requests still in their prompt)
        "req_idx",  # V2: the step's requests -> request states (prompt lengths)
    ),
    # exact K/V by position: each request's prompt length, from the model runner (exact.step_prompt_lens)
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner": ("_build_attention_metadata", "input_batch"),
    "vllm.v1.worker.gpu_input_batch:InputBatch": ("num_prompt_tokens",),
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner": ("prepare_inputs", "req_states"),
    "vllm.v1.worker.gpu.states:RequestState": ("prompt_len",),
    # exact K/V and the prefix cache: hits and cached blocks stop below each request's window
    # (layout.keep_prefix_cache_outside_windows, layout.cap_prefix_cache)
    "vllm.v1.core.sched.scheduler:Scheduler": ("vllm_config", "kv_cache_manager", "block_size"),
    "vllm.v1.core.kv_cache_manager:KVCacheManager": (
        "get_computed_blocks",
        "coordinator",
        "create_kv_cache_blocks",
    ),
    "vllm.v1.core.kv_cache_manager:KVCacheBlocks": ("blocks",),
    "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator": ("cache_blocks",),
    "vllm.v1.request:Request": ("num_prompt_tokens", "num_tokens"),
    "vllm.utils.torch_utils:_encode_layer_name": ("layer_name",),
    "vllm.v1.attention.backend:AttentionBackend": ("forward_includes_kv_cache_update",),
    "vllm.v1.attention.backends.utils:KVSharingFastPrefillMetadata": (
        "logits_indices_padded",
        "num_logits_indices",
    ),
    "vllm.model_executor.layers.quantization.kv_cache:BaseKVCacheMethod": ("create_weights",),
    "vllm.model_executor.layers.layernorm:RMSNorm": ("hidden_size", "eps"),
    "vllm.model_executor.layers.linear:ColumnParallelLinear": (
        "input_size",
        "output_size",
        "bias",
        "quant_config",
        "prefix",
    ),  # fmt: skip
    "vllm.model_executor.layers.linear:RowParallelLinear": (
        "input_size",
        "output_size",
        "bias",
        "quant_config",
        "prefix",
    ),  # fmt: skip
    "vllm.model_executor.layers.linear:MergedColumnParallelLinear": (
        "input_size",
        "output_sizes",
        "bias",
        "quant_config",
        "prefix",
        "weight_loader",
        "weight_loader_v2",
    ),  # fmt: skip
    "vllm.model_executor.layers.linear:LinearBase": ("tp_rank", "tp_size"),
    "vllm.model_executor.model_loader.weight_utils:default_weight_loader": ("param", "loaded_weight"),
    "vllm.model_executor.models.llama:LlamaModel": (
        "vllm_config",
        "prefix",
        "layer_type",
        "embed_input_ids",
        "load_weights",
        "_maybe_add_hidden_state",
    ),  # fmt: skip
    "vllm.model_executor.models.llama:LlamaAttention": ("_init_rotary_emb",),
    "vllm.model_executor.models.llama:LlamaDecoderLayer": ("vllm_config", "prefix", "attn_layer_type"),
    "vllm.model_executor.models.llama:LlamaForCausalLM": (
        "vllm_config",
        "prefix",
        "_init_model",
        "load_weights",
    ),
    "vllm.model_executor.models.qwen3:Qwen3DecoderLayer": (
        "config",
        "cache_config",
        "quant_config",
        "prefix",
    ),
    "vllm.model_executor.models.config:MODELS_CONFIG_MAP": (),
    "vllm.v1.engine.input_processor:InputProcessor": ("process_inputs", "vllm_config"),
    "vllm.v1.engine.input_processor:InputProcessor.process_inputs": ("request_id", "prompt", "params"),
    "vllm.exceptions:VLLMValidationError": ("message",),
    "vllm.model_executor.models.registry:_ModelRegistry": ("models", "get_supported_archs", "register_model"),
    "vllm.model_executor.models.registry:_LazyRegisteredModel": ("module_name", "class_name"),
}

__all__ = [
    "Attention", "CUDAGraphMode", "ColumnParallelLinear", "KVSharingFastPrefillMetadata", "LlamaAttention",
    "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaModel", "MergedColumnParallelLinear", "Qwen3DecoderLayer",
    "RMSNorm", "RowParallelLinear", "USED", "default_weight_loader", "encode_layer_name", "get_forward_context",
    "fast_prefill_utils", "get_pp_group", "get_tensor_model_parallel_world_size", "ignore_torch_compile",
    "is_breakable_cudagraph_enabled",
    "set_model_tag", "support_torch_compile", "unified_attention_with_output", "unified_kv_cache_update",
    "V1ModelRunner",
]  # fmt: skip
