"""SwiftKV configurations: the base family's config plus three fields.

``num_key_value_layers`` (l): layers 0..l-1 are normal; layers l..L-1 take their K/V from the input of layer l.
``key_value_group_size`` (g): AcrossKV, consecutive SwiftKV layers share one K/V in groups of g.
``swiftkv``: True runs the SwiftKV path (student); False runs the exact original model (teacher).
``exact_kv_window`` (W): 0 keeps the published SwiftKV semantics.  W >= 1 turns on exact K/V: every token that
runs layers >= l stores *exact* K/V there (the layer's own ``k_proj``/``v_proj`` on its own normed input), and a
forward runs its last W tokens through layers >= l (W = 1: only the last, which runs them anyway), so the
last W prompt tokens, every generated token and every speculative verification token get exact K/V; all
other prompt tokens keep SwiftKV K/V.  Needs ``key_value_group_size`` 1 (an AcrossKV group shares one K/V,
exact K/V are per layer).

This file travels with every checkpoint for ``trust_remote_code`` loading, so it imports only transformers (and huggingface_hub,
which transformers itself requires).
"""

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig, Qwen2Config, Qwen3Config


class _SwiftKVValidation:
    """The one validation method shared by every SwiftKV config class (fields are declared per class below,
    because transformers turns each config class, not its mixins, into a dataclass)."""

    def validate_architecture(self):
        super().validate_architecture()
        num_layers = self.num_hidden_layers
        if self.num_key_value_layers is None:
            self.num_key_value_layers = num_layers
        l, g = self.num_key_value_layers, self.key_value_group_size
        if not 1 <= l <= num_layers:
            raise ValueError(
                f"num_key_value_layers={l} is outside [1, {num_layers}] (num_hidden_layers={num_layers})"
            )
        if g < 1 or (num_layers - l) % g != 0:
            raise ValueError(
                f"key_value_group_size={g} must divide the {num_layers - l} SwiftKV layers "
                f"(num_hidden_layers={num_layers} - num_key_value_layers={l})"
            )
        w = self.exact_kv_window
        if not isinstance(w, int) or w < 0:
            raise ValueError(f"exact_kv_window={w!r} must be an integer >= 0 (0: off)")
        if w > 0 and g > 1:
            raise ValueError(
                f"exact_kv_window={w} needs key_value_group_size=1, got {g}: an AcrossKV group shares one K/V "
                "across its layers, exact K/V are per layer"
            )
        for layer_type in getattr(self, "layer_types", None) or []:
            if layer_type != "full_attention":
                raise ValueError(
                    f"SwiftKV supports full attention layers only, got layer type {layer_type!r}"
                )

    @property
    def num_swiftkv_groups(self) -> int:
        return (self.num_hidden_layers - self.num_key_value_layers) // self.key_value_group_size

    def kv_cache_layer(self, layer_idx: int) -> int:
        """Index of the cache slot (the group leader) that holds layer ``layer_idx``'s K/V."""
        l, g = self.num_key_value_layers, self.key_value_group_size
        if not self.swiftkv or layer_idx < l:
            return layer_idx
        return l + (layer_idx - l) // g * g


@strict
class LlamaSwiftKVConfig(_SwiftKVValidation, LlamaConfig):
    model_type = "llama_swiftkv"
    num_key_value_layers: int | None = None
    key_value_group_size: int = 1
    swiftkv: bool = True
    exact_kv_window: int = 0


@strict
class Qwen2SwiftKVConfig(_SwiftKVValidation, Qwen2Config):
    model_type = "qwen2_swiftkv"
    num_key_value_layers: int | None = None
    key_value_group_size: int = 1
    swiftkv: bool = True
    exact_kv_window: int = 0


@strict
class Qwen3SwiftKVConfig(_SwiftKVValidation, Qwen3Config):
    model_type = "qwen3_swiftkv"
    num_key_value_layers: int | None = None
    key_value_group_size: int = 1
    swiftkv: bool = True
    exact_kv_window: int = 0
