"""Low-rank KV bases per layer and KV head: the artifact ``swiftkv kvcompress calibrate`` writes.

A factors directory holds ``factors.safetensors`` (tensors), ``factors.json`` (what model they fit),
``policy.json`` (the default compression policy chosen at calibration) and ``provenance.json``.

Design choices (see also ``kvcompress.calibrate``):

- **Keys are factored after RoPE.**  Reconstruction-free attention needs scores ``q·k̂ = (q·B)·c`` with one
  basis ``B`` shared by all tokens.  A pre-RoPE basis would need the position-dependent rotation applied
  to every token's reconstruction (``R_p B c``), i.e. rebuilding K.  Post-RoPE keys have a somewhat flatter
  spectrum (the rotation spreads energy over frequency pairs), which the calibration data covers because it
  contains every position up to its length; with the basis fitted to the queries (below) that costs little: on
  SmolLM2 a pre-RoPE basis leaves only 8-26% less score error at equal rank (8-32; docs/results/kvcompress.md).
- **Bases are the eigenvectors of the uncentred second moment** ``E[k kᵀ]`` (PCA without mean removal),
  sorted by energy, so the first ``r`` columns are the best rank-``r`` subspace for every ``r`` at once:
  a token's rank can be chosen per token by truncation, without a basis per rank.
- **A second key basis fitted to the queries that read the keys** (``scored_key_basis``).  What a key error
  costs is its error on the scores ``q·k``, so this basis is the PCA of keys in the metric of the queries'
  second moment ``Σ_q = E[q qᵀ]`` (over the query heads of the KV group): with ``S = Σ_q^{1/2}`` and ``W`` the
  eigenvectors of ``S Σ_k S``, coefficients are ``c = (S W)ᵀ k`` and queries are mapped by ``S⁻¹ W``
  (``scored_query_basis``, also the reconstruction ``k̂ = c @ scored_query_basisᵀ``), so
  ``q·k ≈ (Wᵀ S⁻¹ q)·c``, exact at full rank, and truncating or quantizing ``c`` costs each score the same in expectation over
  queries.  On SmolLM2 it cuts the score error of a truncation to a half or a third at equal rank (rank 24,
  layer 9, held-out text: 1.8% against 4.4% of the scores' energy); in perplexity at 4k tokens it gains about
  one point (the default policy: +5.6% against +6.7% over the full cache on 16 ShareGPT sequences), in the
  same direction on both text sets and both policies measured, though no single paired interval excludes zero
  (docs/results/kvcompress.md).  The cache uses it unless a tier quantizes keys with per-token scales: in
  the queries' metric a token's coefficients span orders of magnitude (the queries' mean direction
  dominates), so one range per token crushes all but the first (SmolLM2, 4-bit per-token tiers: perplexity
  ×2.4 against ×1.14 with the PCA basis).  Values keep plain
  PCA: weighting them by the output projection gained 5-10% of their error, not worth a second map.
- **Coefficients are not whitened**: ``c = Uᵀk`` in the orthonormal basis, so a quantization error of
  the coefficients is the same error on ``k`` (whitening by each component's RMS was measured worse:
  on SmolLM2, full-rank int4 per-token quantization gave KL 0.060 whitened vs 0.010 unwhitened, because
  whitening makes the quantization error grow with the component's energy).  ``*_scale`` (each
  component's RMS on the calibration data) is kept to report how much energy a rank keeps.
- **An identity basis** (``identity_factors``) turns the same cache into a plain per-token quantizer; the
  benchmark uses it as the uniform-quantization baseline.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch

FACTORS_FILE = "factors.safetensors"
META_FILE = "factors.json"
POLICY_FILE = "policy.json"
FORMAT_VERSION = 2  # 2: the scored key bases (optional; version 1 files, without them, are still read)


@dataclass
class LayerFactors:
    """Bases for one layer's KV: ``*_basis`` ``(heads, d, d)``, columns by energy (coefficients ``c = x @ basis``,
    orthonormal); ``*_scale`` ``(heads, d)`` each coefficient's RMS; ``scored_*`` the key basis fitted to the
    queries and the map for those queries (module docstring), None when calibration saw too few queries."""

    key_basis: torch.Tensor
    key_scale: torch.Tensor
    value_basis: torch.Tensor
    value_scale: torch.Tensor
    scored_key_basis: torch.Tensor | None = None
    scored_query_basis: torch.Tensor | None = None

    def key_energy(self, scored: bool) -> torch.Tensor:
        """``(heads, d)`` mean square of each key coefficient, in the basis fitted to the queries (``scored``,
        where there is one: then a truncation's sum is the expected square score error) or the PCA basis."""
        if not scored or self.scored_key_basis is None:
            return self.key_scale.double() ** 2
        basis, scale = self.key_basis.double(), self.key_scale.double()
        moment = (basis * scale[:, None] ** 2) @ basis.transpose(-1, -2)
        c = self.scored_key_basis.double()
        return torch.einsum("hdi,hde,hei->hi", c, moment, c)


TENSORS = tuple(f.name for f in fields(LayerFactors))  # what a factors file holds per layer (absent: None)


@dataclass
class Factors:
    """Per-layer bases plus the model description they were calibrated on."""

    layers: dict[int, LayerFactors]
    meta: dict

    def check_model(self, config, model=None) -> None:
        """Raise a one-line ValueError if these factors were not made for ``config`` (and ``model``)."""
        expected = model_signature(config)
        for key, value in expected.items():
            if self.meta.get(key) != value:
                raise ValueError(
                    f"factors {self.meta.get('source', '?')} were calibrated for {key}={self.meta.get(key)!r} but the "
                    f"model has {key}={value!r}; to resolve, run `swiftkv kvcompress calibrate` on this model"
                )
        if model is not None and "key_fingerprint" in self.meta:
            got, want = torch.tensor(key_fingerprint(model)), torch.tensor(self.meta["key_fingerprint"])
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-2, atol=1e-3):
                raise ValueError(
                    f"factors {self.meta.get('source', '?')} were calibrated on other weights (first k_proj entries "
                    "differ); to resolve, run `swiftkv kvcompress calibrate` on this model"
                )


def model_signature(config) -> dict:
    """The config fields factors must agree on."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": head_dim,
    }


def key_fingerprint(model: torch.nn.Module) -> list[float]:
    """Two spread-out entries of every key projection (``k_proj*``, SwiftKV's included): they change with the weights."""
    out = []
    for name, weight in model.named_parameters():
        if "k_proj" in name and name.endswith("weight"):
            flat = weight.detach().flatten()
            out += [float(flat[flat.numel() // 3]), float(flat[2 * flat.numel() // 3])]
    return out


def bases_from_moments(second_moment: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-bases of ``(heads, d, d)`` second moments: columns sorted by energy, and each component's RMS."""
    evals, evecs = torch.linalg.eigh(second_moment.double())
    evals, evecs = evals.flip(-1).clamp_min(0), evecs.flip(-1)
    scale = evals.sqrt()
    scale = torch.maximum(scale, eps * scale[..., :1])
    return evecs.float().contiguous(), scale.float().contiguous()


def scored_bases(
    key_moment: torch.Tensor, query_moment: torch.Tensor, eps: float = 1e-4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key bases in the metric of the queries (module docstring): ``(scored_key_basis, scored_query_basis)``
    from ``(heads, d, d)`` second moments of keys and of the queries that read them.  ``eps`` (relative to the
    mean query energy per dimension) keeps directions no calibration query used invertible."""
    q = query_moment.double()
    d = q.shape[-1]
    q = q + eps * q.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * torch.eye(d, dtype=q.dtype)
    evals, evecs = torch.linalg.eigh(q)
    root = evals.sqrt().unsqueeze(-2)
    s, s_inv = (evecs * root) @ evecs.transpose(-1, -2), (evecs / root) @ evecs.transpose(-1, -2)
    w = bases_from_moments(s @ key_moment.double() @ s)[0].double()
    return (s @ w).float().contiguous(), (s_inv @ w).float().contiguous()


def identity_factors(config, dtype: torch.dtype = torch.float32) -> Factors:
    """Factors with the identity basis for every layer: the cache then quantizes raw K/V per token."""
    sig = model_signature(config)
    h, d = sig["num_key_value_heads"], sig["head_dim"]
    eye = torch.eye(d, dtype=dtype).expand(h, d, d).contiguous()
    one = torch.ones(h, d, dtype=dtype)
    layers = {i: LayerFactors(eye, one, eye, one) for i in range(sig["num_hidden_layers"])}
    return Factors(layers, {**sig, "source": "identity", "basis": "identity"})


def save_factors(factors: Factors, out_dir: str | os.PathLike) -> None:
    """Write tensors and metadata into ``out_dir`` (the caller makes the directory atomic)."""
    from safetensors.torch import save_file

    tensors = {}
    for idx, lf in factors.layers.items():
        for name in TENSORS:
            if getattr(lf, name) is not None:
                tensors[f"layers.{idx}.{name}"] = getattr(lf, name).contiguous()
    save_file(tensors, str(Path(out_dir) / FACTORS_FILE))
    meta = {**factors.meta, "format_version": FORMAT_VERSION, "layers": sorted(factors.layers)}
    (Path(out_dir) / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def load_factors(factors_dir: str | os.PathLike) -> Factors:
    """Read a factors directory written by ``swiftkv kvcompress calibrate``."""
    from safetensors.torch import load_file

    factors_dir = Path(factors_dir)
    meta_path, tensor_path = factors_dir / META_FILE, factors_dir / FACTORS_FILE
    if not meta_path.is_file() or not tensor_path.is_file():
        raise FileNotFoundError(
            f"{factors_dir} is not a factors directory (needs {META_FILE} and {FACTORS_FILE}); "
            "to resolve, run `swiftkv kvcompress calibrate MODEL_DIR OUT_DIR`"
        )
    meta = json.loads(meta_path.read_text())
    if meta.get("format_version") not in (1, FORMAT_VERSION):
        raise ValueError(
            f"{meta_path} has format_version {meta.get('format_version')}, this kvcompress reads 1 to {FORMAT_VERSION}; "
            "to resolve, re-run `swiftkv kvcompress calibrate`"
        )
    tensors = load_file(str(tensor_path))
    layers = {
        idx: LayerFactors(**{n: tensors.get(f"layers.{idx}.{n}") for n in TENSORS}) for idx in meta["layers"]
    }
    return Factors(layers, meta)
