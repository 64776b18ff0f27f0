"""The calibration default, written once for ``calibrate()``, ``Policy``, the evaluation and the command line.

``--rank-budget 0.5 --bits 4,4,2 --value-bits 4,2,2 --scales cc``: keys of the middle tier at 4 bits, values at 2,
halved the former default's loss for 8% more memory on the 2026-12-07 sweep (:mod:`.policy`'s docstring,
docs/results/kvcompress.md).  No torch here: ``swiftkv kvcompress --help``
reads these without importing it.
"""

RANK_BUDGET = 0.5  # average key rank / head_dim of compressed tokens
BITS = (4, 4, 2)  # keys' bit width per tier, most significant first
VALUE_BITS = (4, 2, 2)  # values' bit width per tier (calibrate() also takes None: as the keys')
SCALES = "cc"  # key and value scales: c per channel over groups of tokens, t per token
SINKS = 4  # first tokens kept exact (attention sinks)
WINDOW = 64  # most recent tokens kept exact
BLOCK = 32  # compress once this many tokens have left the window
DATA = "sharegpt"  # calibration conversations
SAMPLES = 64  # calibration sequences
MAX_LENGTH = 2048  # tokens per calibration sequence: the context length served
SENSITIVITY_SAMPLES = 4  # calibration sequences on which each layer's key truncation is measured (0: none)
SENSITIVITY_TOKENS = 128  # continuation tokens of each (at most a quarter of the sequence)
