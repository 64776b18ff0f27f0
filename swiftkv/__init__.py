"""SwiftKV: later layers' KV computed from one earlier layer's output, so prompt tokens skip those layers.

Importing the package registers the ``llama_swiftkv`` / ``qwen2_swiftkv`` model types with transformers'
Auto classes, so ``AutoModelForCausalLM.from_pretrained(dir)`` works without ``trust_remote_code``.
"""

__version__ = "0.1.0"
