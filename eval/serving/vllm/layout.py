"""Where a SwiftKV checkpoint's layers and tensors go in the vLLM model, how K/V heads split over ranks, and which
rows of a step store exact K/V.

Pure Python (no vLLM, no torch), so the name routing, the tensor-parallel head split and the exact-K/V rows are
checked without starting an engine; ``eval.serving.vllm.llama`` builds and loads the model from them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

# any tensor of a SwiftKV projection (weight, bias, and quantization tensors such as weight_scale, input_scale)
_SWIFTKV = re.compile(r"^layers\.(\d+)\.self_attn\.([qkv])_(proj|norm)_swiftkv\.(\w+)$")
# the teacher's q/k/v (and Qwen3's per-head q/k norms), unused by the SwiftKV layers
_TEACHER_QKV = re.compile(r"^layers\.(\d+)\.self_attn\.([qkv]_proj|[qk]_norm)\.\w+$")
# Quantization scales of a SwiftKV projection's output, in the forms checkpoints carry them (ModelOpt:
# ``k_proj_swiftkv.k_scale``, after vLLM's quantization name mapper ``k_proj_swiftkv.attn.k_scale``;
# compressed-tensors: ``k_proj_swiftkv.output_scale``): K/V scales belong to the attention holding the group's
# cache, a query scale to the layer's own attention
_SWIFTKV_OUTPUT_SCALE = re.compile(
    r"^layers\.(\d+)\.self_attn\.([qkv])_proj_swiftkv\.(?:attn\.)?(?:[qkv]_scale|output_scale)$"
)
# the same scales on the teacher's K/V projections, which compute the exact K/V of layers >= l
_TEACHER_KV_OUTPUT_SCALE = re.compile(
    r"^layers\.(\d+)\.self_attn\.([kv])_proj\.(?:attn\.)?(?:[kv]_scale|output_scale)$"
)


@dataclass(frozen=True)
class Route:
    """A checkpoint tensor's destination: ``target`` (a parameter name relative to ``model.``) and, for the fused
    K/V projection, which of its ``2 * groups`` shards (K then V of each group)."""

    target: str
    shard: int | None = None


TO_VLLM = Route("")  # the rest of the Llama: vLLM's own loader maps it (q/k/v into qkv_proj, scales included)


def kv_head_split(total_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """``(kv heads per rank, ranks holding each head)`` by vLLM's QKVParallelLinear rule: heads are split when
    there are at least as many as ranks, else each rank holds one head and every head is replicated."""
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise ValueError(
                f"num_key_value_heads={total_kv_heads} is not divisible by tensor_parallel_size={tp_size}"
            )
        return total_kv_heads // tp_size, 1
    if tp_size % total_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp_size} is not a multiple of num_key_value_heads={total_kv_heads}"
        )
    return 1, tp_size // total_kv_heads


def kv_head_slice(tp_rank: int, total_kv_heads: int, tp_size: int) -> range:
    """The KV heads tensor-parallel rank ``tp_rank`` holds (whole heads; a head replicated on ``tp_size //
    total_kv_heads`` consecutive ranks when there are more ranks than heads)."""
    per_rank, replicas = kv_head_split(total_kv_heads, tp_size)
    first = tp_rank // replicas * per_rank
    return range(first, first + per_rank)


class SwiftKVLayout:
    """Which layers are SwiftKV layers, their group leaders, the checkpoint names that must exist, and where
    every checkpoint tensor is loaded."""

    def __init__(self, config):
        self.num_layers = config.num_hidden_layers
        self.first = config.num_key_value_layers if config.swiftkv else self.num_layers
        self.group_size = config.key_value_group_size
        self.leaders = list(range(self.first, self.num_layers, self.group_size))
        self.bias = bool(getattr(config, "qkv_bias", getattr(config, "attention_bias", False)))
        self.qk_norm = config.model_type == "qwen3_swiftkv"
        # exact K/V (W >= 1): every layer >= l also keeps the teacher's k/v projections (and Qwen3's k_norm)
        self.window = (getattr(config, "exact_kv_window", 0) or 0) if self.leaders else 0

    def leader_of(self, layer: int) -> int:
        return self.first + (layer - self.first) // self.group_size * self.group_size

    def required_weights(self) -> set[str]:
        """Checkpoint names (relative to ``model.``) of the SwiftKV weights the student path needs."""
        if not self.leaders:
            return set()
        kinds = ("weight", "bias") if self.bias else ("weight",)
        names = {"norm_swiftkv.weight"}
        for j in range(self.first, self.num_layers):
            projs = ("q", "k", "v") if j in self.leaders else ("q",)
            names |= {f"layers.{j}.self_attn.{p}_proj_swiftkv.{k}" for p in projs for k in kinds}
            if self.qk_norm:
                norms = ("q", "k") if j in self.leaders else ("q",)
                names |= {f"layers.{j}.self_attn.{p}_norm_swiftkv.weight" for p in norms}
            if self.window:
                names |= {f"layers.{j}.self_attn.{p}_proj.{k}" for p in ("k", "v") for k in kinds}
                names |= {f"layers.{j}.self_attn.k_norm.weight"} if self.qk_norm else set()
        return names

    def route(self, name: str) -> Route | None:
        """Where checkpoint tensor ``name`` (relative to ``model.``) goes: a SwiftKV parameter, ``TO_VLLM``, or
        None for a tensor this mode never uses (the SwiftKV tensors in teacher mode; the teacher q/k/v of layers
        >= l and the K/V of AcrossKV non-leaders in SwiftKV mode).  With exact K/V the teacher k/v of every layer
        >= l go into its fused ``exact_kv_proj`` (shards k, v), Qwen3's k_norm into ``exact_k_norm``, and their
        KV-cache scales onto the layer's attention, so the group's shared scale covers exact K/V too."""
        swift = _SWIFTKV.match(name)
        if not self.leaders:
            return None if swift is not None or name.startswith("norm_swiftkv.") else TO_VLLM
        if name.startswith("norm_swiftkv."):
            return Route(name)
        scale = _SWIFTKV_OUTPUT_SCALE.match(name)
        if scale is not None:
            j, proj = int(scale[1]), scale[2]
            if j < self.first or (proj != "q" and j not in self.leaders):
                return None
            return Route(
                f"layers.{j}.self_attn.attn.q_scale" if proj == "q" else f"swiftkv_kv.{j}.{proj}_scale"
            )
        if swift is not None:
            j, proj, kind, tensor = int(swift[1]), swift[2], swift[3], swift[4]
            if j < self.first:
                return None
            if proj == "q":
                return Route(name)
            if j not in self.leaders:
                return None
            if kind == "norm":  # k_norm_swiftkv (Qwen3): one per group, applied before RoPE
                return Route(f"k_norm_swiftkv.{self.leaders.index(j)}.{tensor}")
            return Route(f"kv_proj_swiftkv.{tensor}", 2 * self.leaders.index(j) + (proj == "v"))
        teacher_scale = _TEACHER_KV_OUTPUT_SCALE.match(name)
        if self.window and teacher_scale is not None and int(teacher_scale[1]) >= self.first:
            return Route(f"layers.{teacher_scale[1]}.self_attn.attn.{teacher_scale[2]}_scale")
        teacher = _TEACHER_QKV.match(name)
        if teacher is not None and int(teacher[1]) >= self.first:
            j, part = teacher[1], teacher[2]
            tensor = name.rsplit(".", 1)[1]
            if not self.window or part in ("q_proj", "q_norm"):
                return None
            if part == "k_norm":
                return Route(f"layers.{j}.self_attn.exact_k_norm.{tensor}")
            return Route(f"layers.{j}.self_attn.exact_kv_proj.{tensor}", int(part == "v_proj"))
        return TO_VLLM


def exact_rows(
    query_start_loc: Sequence[int], seq_lens: Sequence[int], prompt_lens: Sequence[int], window: int
) -> tuple[list[int], list[bool], int]:
    """The rows of a step that run layers >= l with ``exact_kv_window = window``, whether each stores exact K/V
    there, and the most rows of one request.

    The rule: position p of a request stores exact K/V iff ``p >= prompt_len - window`` (its prompt's last
    ``window`` tokens, and every token it generated, including outputs recomputed after a preemption, which vLLM
    re-prefills at positions >= prompt_len).  It depends on the request alone, never on where the scheduler cut
    its prompt.  A request's rows in a step are positions ``seq_len - q_len .. seq_len - 1`` (``query_start_loc``:
    the step's request boundaries; ``seq_lens``: each request's length after the step; ``prompt_lens``: its
    prompt's), so its exact rows are a suffix of them.  A request with none (a chunk that ends before its window)
    still runs its last row, the runner's logits row of that chunk, whose logits vLLM discards, and writes
    nothing there, so every request keeps at least one row (vLLM's metadata for the upper layers has none with
    zero queries).  Logits rows that matter (a prompt's last token, every decode or verification row) are
    exact rows.  A request with no tokens (vLLM's padding) adds nothing."""
    rows: list[int] = []
    writes: list[bool] = []
    widest = 0
    for r, (start, end) in enumerate(zip(query_start_loc[:-1], query_start_loc[1:], strict=True)):
        q = end - start
        if q <= 0:
            continue
        computed = seq_lens[r] - q
        exact = min(q, max(0, computed + q - (prompt_lens[r] - window)))
        take = max(exact, 1)
        rows.extend(range(end - take, end))
        writes.extend([exact > 0] * take)
        widest = max(widest, take)
    return rows, writes, widest


def padded_count(count: int, sizes: Sequence[int], limit: int) -> int:
    """``count`` rows padded to the smallest of ``sizes`` (the captured CUDA-graph batch sizes) that holds them, as
    vLLM pads the logits rows, or ``count`` when none does; never above ``limit`` (the static buffers' rows)."""
    return min((s for s in sizes if count <= s <= limit), default=count)


def captured_sizes(compilation_config) -> frozenset[int]:
    """The batch sizes vLLM captures CUDA graphs for, as its compilation config says now.  Read when used: vLLM's V1
    runner rewrites ``cudagraph_capture_sizes`` after the model is built (to multiples of 1 + the speculative
    tokens, ``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode``)."""
    return frozenset(compilation_config.cudagraph_capture_sizes or ())


def exact_hit_cap(prompt_len: int, window: int, block_size: int) -> int:
    """The most prompt tokens a request with exact K/V may take from the prefix cache, or put in it: the blocks
    that end at or before ``prompt_len - window``, where its window starts.  So every position of its window is
    computed by the request itself, and no cached block ever holds an exact row (a window or a generated token)
    that another request could read as its own prompt."""
    return max(0, prompt_len - window) // block_size * block_size


def cap_prefix_cache(manager, window: int, block_size: int) -> None:
    """Hold vLLM's KV cache manager ``manager`` (of one scheduler) to ``exact_hit_cap``: its prefix-cache hits
    (``get_computed_blocks``, which every lookup of the scheduler goes through) are cut to the cap, and its
    coordinator caches a request's blocks up to the cap only (``cache_blocks``, which ``allocate_slots`` and the
    async scheduler call).  Duck-typed, so it is checked without vLLM."""
    lookup, coordinator = manager.get_computed_blocks, manager.coordinator
    cache = coordinator.cache_blocks

    def get_computed_blocks(request):
        blocks, hit, *rest = lookup(request)
        cap = exact_hit_cap(request.num_prompt_tokens, window, block_size)
        if hit > cap:
            keep = cap // block_size
            blocks = manager.create_kv_cache_blocks(tuple(list(group[:keep]) for group in blocks.blocks))
            hit = cap
        return (blocks, hit, *rest)

    def cache_blocks(request, num_tokens, *args, **kwargs):
        cap = exact_hit_cap(request.num_prompt_tokens, window, block_size)
        return cache(request, min(num_tokens, cap), *args, **kwargs)

    manager.get_computed_blocks = get_computed_blocks
    coordinator.cache_blocks = cache_blocks


def skips_layers(hf_config) -> bool:
    """Whether a checkpoint config runs the SwiftKV path with at least one SwiftKV layer."""
    return bool(getattr(hf_config, "swiftkv", False)) and (
        hf_config.num_key_value_layers < hf_config.num_hidden_layers
    )


def served_exact_kv_window(vllm_config) -> int:
    """The exact-K/V window W an engine serves the checkpoint with: the config's ``exact_kv_window`` for a SwiftKV
    checkpoint that skips layers with vLLM's fast prefill on (without it the engine is refused at start,
    ``exact_kv_refusal``), else 0."""
    hf_config = vllm_config.model_config.hf_config
    window = getattr(hf_config, "exact_kv_window", 0) or 0
    if not window or not skips_layers(hf_config) or not vllm_config.cache_config.kv_sharing_fast_prefill:
        return 0
    return window


def keep_prefix_cache_outside_windows(scheduler_cls) -> None:
    """Make every scheduler of ``scheduler_cls`` (vLLM's V1 ``Scheduler``, which ``AsyncScheduler`` extends) of an
    engine serving exact K/V hold its KV cache manager to ``exact_hit_cap`` (``cap_prefix_cache``).  Installed at
    plugin registration, which vLLM runs in the engine-core process, where the scheduler lives (``EngineCore``
    loads the general plugins first); an engine without exact K/V is left as it is."""
    init = scheduler_cls.__init__
    if getattr(init, "swiftkv_prefix_cap", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        window = served_exact_kv_window(self.vllm_config)
        if window:
            cap_prefix_cache(self.kv_cache_manager, window, self.block_size)

    __init__.swiftkv_prefix_cap = True
    scheduler_cls.__init__ = __init__
