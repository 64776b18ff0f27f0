"""Certaindex (Dynasor): stop reasoning once the model's answer is certain.

- ``cot.run_cot``: chain of thought with probe-in-the-middle early exit (presets in ``certainty.PRESETS``).
- ``sc.run_sc`` / ``sc.calibrate``: self-consistency that stops sampling when certaindex >= a threshold,
  and the threshold that keeps a target accuracy on a dev split.
- ``engines.load_backend``: a transformers model directory or an OpenAI-compatible ``http://.../v1`` URL.

CLI: ``swiftkv certaindex {cot,sc,calibrate,serve} --help``.  Importing this package is cheap: torch
and transformers load only when a transformers backend is created.
"""

from .answers import answers_equal, extract_final_answer, extract_probe_answer
from .backends import Sampling
from .certainty import PRESETS, Probe, certaindex, should_exit
from .engines import load_backend

__all__ = [
    "PRESETS",
    "Probe",
    "Sampling",
    "answers_equal",
    "certaindex",
    "extract_final_answer",
    "extract_probe_answer",
    "load_backend",
    "should_exit",
]
