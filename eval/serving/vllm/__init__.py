"""vLLM plugin that serves SwiftKV checkpoints with real prefill skipping.

vLLM runs ``register()`` in every one of its processes through the ``vllm.general_plugins`` entry point of
this distribution, without a guard of its own: an exception there would stop vLLM from starting for every
model in the environment.  So ``register()`` imports vLLM's internals (``internals.py``) only inside its own
guard, and a failure logs one line and leaves vLLM as it was.  It registers the ``*_swiftkv`` config classes
with transformers' AutoConfig, the SwiftKV model classes with vLLM's ModelRegistry (by import string, so the
model module loads only when a SwiftKV checkpoint is served), and a config hook that decides vLLM's
``kv_sharing_fast_prefill`` for SwiftKV checkpoints: that is what lets only the rows that need logits continue
through layers >= l.

Fast prefill is on by default and can be turned off per environment (``SWIFTKV_FAST_PREFILL=0``) or per engine
(``hf_overrides={"swiftkv_fast_prefill": false}``): every row then runs the upper layers (the SwiftKV math is
unchanged, the prefill saving is gone), which is what prompt log-probabilities and scoring need.  A checkpoint
with exact K/V (``exact_kv_window >= 1``) needs fast prefill on: its exact rows are the rows fast prefill runs
through layers >= l, so the config hook refuses an engine without it (``exact_kv_refusal``).

Importing this package imports neither vLLM nor torch.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

from eval.serving.vllm.layout import skips_layers  # stdlib only: the plugin's import stays light

MODEL_CLASSES = {
    "LlamaSwiftKVForCausalLM": "eval.serving.vllm.llama:LlamaSwiftKVForCausalLM",
    "Qwen2SwiftKVForCausalLM": "eval.serving.vllm.llama:Qwen2SwiftKVForCausalLM",
    "Qwen3SwiftKVForCausalLM": "eval.serving.vllm.llama:Qwen3SwiftKVForCausalLM",
}
FAST_PREFILL_ENV = "SWIFTKV_FAST_PREFILL"
FAST_PREFILL_OVERRIDE = "swiftkv_fast_prefill"  # hf_overrides key: a per-engine choice, beats the environment
PROMPT_LOGPROBS_REFUSED = (
    "prompt_logprobs need every prompt token through layers >= l, which SwiftKV's fast prefill skips (to "
    f"resolve, serve this checkpoint with {FAST_PREFILL_ENV}=0, or hf_overrides "
    f'{{"{FAST_PREFILL_OVERRIDE}": false}}, for scoring)'
)

# a child of vLLM's logger, so the lines look like vLLM's own and follow its logging configuration
logger = logging.getLogger("vllm.swiftkv_toolkit")


def fast_prefill_switch(hf_config) -> bool:
    """The user's switch: ``hf_overrides={"swiftkv_fast_prefill": bool}``, else ``SWIFTKV_FAST_PREFILL`` (0/1),
    else on."""
    override = getattr(hf_config, FAST_PREFILL_OVERRIDE, None)
    if override is not None:
        if not isinstance(override, bool):
            raise ValueError(
                f"hf_overrides {FAST_PREFILL_OVERRIDE}={override!r} is not a boolean (to resolve, pass true or false)"
            )
        return override
    value = os.environ.get(FAST_PREFILL_ENV, "1").strip().lower()
    if value not in ("0", "1"):
        raise ValueError(
            f"{FAST_PREFILL_ENV}={value!r} is not 0 or 1 (to resolve, set it to 0 or 1, or unset it)"
        )
    return value == "1"


def fast_prefill_reason(vllm_config) -> str | None:
    """None when vLLM's fast prefill should run for this engine, else why not (logged at start)."""
    hf_config = vllm_config.model_config.hf_config
    if not skips_layers(hf_config):
        return "the checkpoint has no SwiftKV layers (teacher mode, or l = L)"
    if not fast_prefill_switch(hf_config):
        return f"turned off ({FAST_PREFILL_ENV}=0 or hf_overrides {FAST_PREFILL_OVERRIDE}=false)"
    spec = vllm_config.speculative_config
    if spec is not None and spec.use_eagle():
        return f"speculative method {spec.method!r} drafts from the hidden states of every prompt token"
    if getattr(vllm_config.compilation_config.cudagraph_mode, "name", None) == "FULL":
        # FULL (not FULL_AND_PIECEWISE) replays mixed prefill/decode steps as one graph captured on all rows
        return "cudagraph_mode FULL captures mixed prefill/decode steps whole (FULL_AND_PIECEWISE keeps it)"
    return None


def fast_prefill_refusal(vllm_config, backend: str, breakable_cudagraphs: bool = False) -> str | None:
    """Why an engine whose config hook turned fast prefill on cannot serve with it, from what vLLM resolved after
    the hook (checked when the model is built), or None.  ``breakable_cudagraphs``: vLLM's
    ``is_breakable_cudagraph_enabled()``, which ``VllmConfig._maybe_enable_breakable_cudagraph`` may turn on after
    the hook (``VLLM_BATCH_INVARIANT=1`` does so for bf16 shapes it has tuned tiles for, such as Llama-3-8B's on
    H100).

    * ``cudagraph_mode`` FULL: the hook refuses it (``fast_prefill_reason``), but ``VllmConfig.__post_init__``
      resolves the mode after ``try_verify_and_update_config``: ``CompilationConfig.set_splitting_ops_for_v1``
      makes FULL_AND_PIECEWISE FULL where no splitting ops are left (an empty ``-cc.splitting_ops``, or the
      attention + quant fusion pass ``fuse_attn_quant``), and a FULL graph would replay a mixed step's
      data-dependent row gather as captured.  (``_normalize_piecewise_cudagraph_mode``, which runs there too, makes
      it FULL_DECODE_ONLY without piecewise compilation: mixed steps eager, which is safe.)
    * Breakable CUDA graphs (``VLLM_USE_BREAKABLE_CUDAGRAPH``) in place of piecewise ones: they capture the whole
      forward once per size and replay only the attention ops eagerly (``vllm/compilation/breakable_cudagraph.py``),
      so the model's per-step choice of the rows that run layers >= l (``LlamaSwiftKVModel._decode_rows``, Python
      between the two stacks) is frozen at its capture-time value while the runner keeps building the upper
      layers' metadata for the logits rows: wrong tokens, silently.
    * FlashInfer, FlexAttention, and decode context parallel with any backend: their metadata builders read
      ``query_start_loc_cpu`` on the host (FlexAttention in ``FlexAttentionMetadata.__post_init__`` through
      ``_offsets_to_doc_ids_tensor``), which vLLM's fast-prefill metadata fills by a non-blocking device-to-host copy
      (``make_kv_sharing_fast_prefill_common_attn_metadata``), so they may plan with values not yet copied (vLLM's
      own gemma3n shares this exposure).
    * Prefill context parallel: the V2 runner (the only one that runs it) builds its fast-prefill helper only
      without it (``GPUModelRunner.initialize_kv_cache``: ``kv_sharing_fast_prefill and self.pcp_manager is
      None``), so every row would silently run every layer, and exact K/V would mark every prompt token exact."""
    if not vllm_config.cache_config.kv_sharing_fast_prefill:
        return None
    fix = f"{FAST_PREFILL_ENV}=0 (every row through every layer)"
    mode = getattr(vllm_config.compilation_config.cudagraph_mode, "name", None)
    if mode == "FULL":
        return (
            "cudagraph_mode resolved to FULL after the SwiftKV config hook (vLLM does so where no splitting ops are "
            "left: an empty -cc.splitting_ops, or the attention + quant fusion pass), which replays mixed steps "
            f"whole (to resolve, serve with -cc.cudagraph_mode=FULL_DECODE_ONLY, or without those, or {fix})"
        )
    if breakable_cudagraphs and mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        return (
            "breakable CUDA graphs (VLLM_USE_BREAKABLE_CUDAGRAPH=1, which VLLM_BATCH_INVARIANT=1 turns on unless it "
            "is set) freeze SwiftKV's choice of the rows that run layers >= l at capture (to resolve, set "
            f"VLLM_USE_BREAKABLE_CUDAGRAPH=0, or serve with -cc.cudagraph_mode=FULL_DECODE_ONLY, or with {fix})"
        )
    if backend.upper().startswith(("FLASHINFER", "FLEX_ATTENTION")):
        return (
            f"the {backend} attention backend plans on host copies of the offsets that SwiftKV's fast prefill "
            f"fills asynchronously (to resolve, pick --attention-backend FLASH_ATTN, or serve with {fix})"
        )
    if getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) > 1:
        return (
            "decode context parallel reads host copies of the offsets that SwiftKV's fast prefill fills "
            f"asynchronously (to resolve, serve with --decode-context-parallel-size 1, or with {fix})"
        )
    if getattr(vllm_config.parallel_config, "prefill_context_parallel_size", 1) > 1:
        return (
            "prefill context parallel makes vLLM's V2 runner skip SwiftKV's fast prefill without a word, so every "
            "row would run every layer (to resolve, serve with --prefill-context-parallel-size 1, or with "
            f"{fix})"
        )
    return None


def exact_kv_refusal(vllm_config, fast_prefill_off: str | None) -> str | None:
    """Why this engine cannot serve the checkpoint's exact K/V (``exact_kv_window = W >= 1``), or None.

    The rows that store exact K/V are the rows vLLM's fast prefill runs through layers >= l (W = 1: the logits
    rows; W > 1: each request's rows at positions >= prompt_len - W, which the model has vLLM build the upper
    layers' metadata for), so:
    fast prefill must be on (``fast_prefill_off`` is its reason otherwise: with every row through every layer the
    rows that count as generated are unknown to the model); W > 1 must cover a verification's rows
    (``W >= 1 + num_speculative_tokens``), which are all logits rows; and the per-request rows come from the
    step's request boundaries, which adaptive verification moves on the device and micro-batching splits."""
    hf_config = vllm_config.model_config.hf_config
    window = getattr(hf_config, "exact_kv_window", 0) or 0
    if not window or not skips_layers(hf_config):
        return None
    name = f"exact_kv_window={window}"
    if fast_prefill_off is not None:
        return (
            f"{name} needs SwiftKV fast prefill, which is off here: {fast_prefill_off} (to resolve, serve with fast "
            "prefill on, or score with the transformers path, or set exact_kv_window to 0 in config.json)"
        )
    spec = vllm_config.speculative_config
    drafts = getattr(spec, "num_speculative_tokens", None) or 0
    if 1 < window < 1 + drafts:
        return (
            f"{name} is shorter than a speculative verification (1 + num_speculative_tokens={drafts} rows) (to "
            f"resolve, use exact_kv_window 1 or >= {1 + drafts}, or at most {window - 1} speculative tokens)"
        )
    if getattr(spec, "enable_adaptive_verification", False):  # W = 1 too: its rows come from the boundaries
        return (
            f"{name} cannot follow adaptive verification, which trims the verified drafts on the device (to "
            "resolve, set enable_adaptive_verification false in the speculative config)"
        )
    parallel = getattr(vllm_config, "parallel_config", None)
    if getattr(parallel, "use_ubatching", False):
        return (
            f"{name} does not support micro-batching, which builds each micro-batch's attention metadata apart "
            "(to resolve, serve without --enable-dbo and with ubatch_size 1)"
        )
    return None


class SwiftKVConfigHook:
    """vLLM per-architecture config hook (``MODELS_CONFIG_MAP``): decides ``kv_sharing_fast_prefill`` for SwiftKV
    checkpoints (vLLM then builds the upper layers' attention metadata for the logits rows only), refuses a
    pooling runner, which would read the rows that skipped the upper layers, and an engine that cannot serve the
    checkpoint's exact K/V (``exact_kv_refusal``)."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        return None

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        reason = fast_prefill_reason(vllm_config)
        refusal = exact_kv_refusal(vllm_config, reason)
        if refusal is not None:
            raise ValueError(refusal)
        runner = getattr(vllm_config.model_config, "runner_type", "generate")
        if reason is None and runner == "pooling":
            raise ValueError(
                "a SwiftKV checkpoint with fast prefill cannot run as a pooling model: prompt tokens skip layers "
                f">= l (to resolve, serve it for generation, or set {FAST_PREFILL_ENV}=0 to run every token "
                "through every layer)"
            )
        vllm_config.cache_config.kv_sharing_fast_prefill = reason is None
        if reason is not None and skips_layers(vllm_config.model_config.hf_config):
            logger.info("SwiftKV fast prefill is off: %s; every prompt token runs every layer", reason)


def refuse_prompt_logprobs(vllm_config, params, error: Callable[[str], Exception] = ValueError) -> None:
    """Refuse one request that asks for prompt log-probabilities from a SwiftKV engine with fast prefill on.

    vLLM's async server refuses such requests only when ``prompt_logprobs`` is truthy (0 passes), and its offline
    engine not at all: the worker then dies on an assertion and takes every other request with it.  ``error``
    makes the exception: inside vLLM its request-validation error, which the server answers with a 400."""
    if (
        getattr(params, "prompt_logprobs", None) is not None
        and vllm_config.cache_config.kv_sharing_fast_prefill
        and vllm_config.model_config.architecture in MODEL_CLASSES
    ):
        raise error(PROMPT_LOGPROBS_REFUSED)


def _guard_prompt_logprobs(input_processor_cls, error: Callable[[str], Exception]) -> None:
    """Make vLLM's request intake (``InputProcessor.process_inputs``) call ``refuse_prompt_logprobs`` first."""
    original = input_processor_cls.process_inputs
    if getattr(original, "swiftkv_guard", False):  # plugins are loaded once per vLLM process, maybe more
        return

    @functools.wraps(original)
    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        refuse_prompt_logprobs(self.vllm_config, params, error)
        return original(self, request_id, prompt, params, *args, **kwargs)

    process_inputs.swiftkv_guard = True
    input_processor_cls.process_inputs = process_inputs


def _registered_as(registry, arch: str) -> str:
    model = registry.models.get(arch)
    module, name = getattr(model, "module_name", None), getattr(model, "class_name", None)
    if module and name:
        return f"{module}:{name}"
    model_cls = getattr(model, "model_cls", None)
    return f"{model_cls.__module__}:{model_cls.__qualname__}" if model_cls is not None else repr(model)


def _register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.exceptions import VLLMValidationError
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.input_processor import InputProcessor

    from eval.serving.vllm.layout import keep_prefix_cache_outside_windows
    from swiftkv.configuration_swiftkv import LlamaSwiftKVConfig, Qwen2SwiftKVConfig, Qwen3SwiftKVConfig

    for config_class in (LlamaSwiftKVConfig, Qwen2SwiftKVConfig, Qwen3SwiftKVConfig):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    for arch, target in MODEL_CLASSES.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, target)
        elif (owner := _registered_as(ModelRegistry, arch)) != target:
            logger.warning(
                "%s is already registered with vLLM as %s (ArcticInference registers the same name), so that class "
                "serves SwiftKV checkpoints, not swiftkv-toolkit's (to use this plugin's, run vLLM with "
                "VLLM_PLUGINS=swiftkv)",
                arch,
                owner,
            )
        MODELS_CONFIG_MAP.setdefault(arch, SwiftKVConfigHook)
    _guard_prompt_logprobs(
        InputProcessor, functools.partial(VLLMValidationError, parameter="prompt_logprobs")
    )
    keep_prefix_cache_outside_windows(Scheduler)  # exact K/V: no prefix hit or cached block inside a window


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make vLLM load ``llama/qwen2/qwen3_swiftkv`` checkpoints.

    Never raises: vLLM calls general plugins without a guard, so a failure here (a vLLM version that moved a
    name the plugin needs) is logged in one line and vLLM keeps serving every other architecture."""
    try:
        _register()
    except Exception as exc:  # noqa: BLE001 - any failure must leave vLLM usable for other models
        logger.warning(
            "swiftkv-toolkit's vLLM plugin is not registered, SwiftKV checkpoints cannot be served here: %s: %s "
            "(to resolve, use a vLLM version in the tested range, see docs/serving.md)",
            type(exc).__name__,
            exc,
        )
