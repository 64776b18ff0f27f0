"""Where does a SwiftKV student's error come from?  ``swiftkv diagnose CHECKPOINT`` (forward passes only).

Two measurements on the recipe's held-out rows, both against the teacher (the same weights in original mode):

With exact K/V (a checkpoint with ``exact_kv_window``), the student's layers outside the swapped block take
exact K/V at the served positions of each row, as in training.

* **Oracle per block.** The SwiftKV layers are cut into blocks of ``block_layers``; for each block the student
  runs with the teacher's own K/V (its cache, from the teacher's hidden states) in that block's layers, once
  with the student's queries and once with the teacher's query projection too, and the held-out KL it reaches
  is recorded.  ``1 - KL_oracle / KL_student`` is the share of the error that perfect K/V in that block could
  remove: an upper bound of what any K/V predictor there can buy.  With every block swapped together and the
  teacher's queries, the student *is* the teacher (KL 0; the tests check it).
* **Probes.** How well can the teacher's pre-RoPE keys and values of every later layer ``j``,
  ``k/v_proj_j(norm_j(x_j))``, be predicted from ``h = norm_swiftkv(x_l)``?  Fitted on the first ``fit_rows``
  training rows, scored on the held-out rows as relative squared error, ``sum ||y_hat - y||^2 / sum ||y||^2``:
  (a) ``linear``: ridge on the current token (what SwiftKV's K/V projection is, and what the least-squares init
  fits); (b) ``mlp``: that linear map plus a small MLP trained on the residual (more capacity, same token);
  (c) ``context``: ridge on the current and ``neighbours - 1`` previous tokens of the same sample (more
  context, no more capacity per token).  ``checkpoint`` is the checkpoint's own K/V projections.  If the MLP
  closes much more of the error than the context map, a per-token capacity lever is the one to try, and
  the other way round.

``--exact-kv W`` measures something else, also with forward passes only: what exact K/V for the tokens that run
every layer would buy the checkpoint as it is (``distill.served.exact_kv_table``: KL in five regimes on the
held-out conversations ``eval quality`` scores), before any training in that regime.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call

from swiftkv.convert import read_config
from toolkit.artifacts import read_provenance, write_json_atomic
from toolkit.cliargs import UsageError, add_limit, add_model, add_out, run

from .objective import agreement_metrics, metrics_from_sums, served_positions

EPILOG = """examples:
  swiftkv diagnose out/distill/smollm2-swiftkv50/model --out out/diagnose50
  swiftkv diagnose out/x/converted --recipe swiftkv_smollm2_cpu --block-layers 5 --out out/d
  swiftkv diagnose out/distill/smollm2-swiftkv50/model --exact-kv 32 --out out/exact50
"""


# -- the probes: plain tensors in, relative errors out ---------------------------------------------------------
@dataclass
class ProbeData:
    """Rows of features ``h`` [rows, seq, d], ``position_ids`` [rows, seq] (restarting per packed sample) and
    targets [rows, seq, m] whose columns are ``blocks`` consecutive equal parts (one per layer and K or V)."""

    h: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor


def context_features(h: torch.Tensor, position_ids: torch.Tensor, neighbours: int) -> torch.Tensor:
    """[rows, seq, neighbours * d]: each token's ``h`` followed by those of the ``neighbours - 1`` tokens before
    it in the same sample (zeros before the sample's first token)."""
    parts = [h]
    for shift in range(1, neighbours):
        prev = torch.zeros_like(h)
        prev[:, shift:] = h[:, :-shift]
        prev[position_ids < shift] = 0  # the token `shift` back belongs to another sample (or none)
        parts.append(prev)
    return torch.cat(parts, -1)


def ridge_fit(x: torch.Tensor, y: torch.Tensor, ridge: float) -> torch.Tensor:
    """[(features + 1), m] float64 ridge solution of y ~ [x, 1] W; lambda = ``ridge`` x the mean feature energy."""
    x = torch.cat([x.double(), x.new_ones(len(x), 1, dtype=torch.float64)], 1)
    gram = x.T @ x
    eye = torch.eye(len(gram), dtype=torch.float64)
    return torch.linalg.solve(gram + ridge * gram.diagonal().mean() * eye, x.T @ y.double())


def ridge_apply(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w[:-1] + w[-1]).float()


def relative_errors(pred: torch.Tensor, target: torch.Tensor, blocks: int) -> list[float]:
    """``sum ||pred - target||^2 / sum ||target||^2`` per column block."""
    err = (pred - target).double().pow(2).reshape(len(target), blocks, -1).sum((0, 2))
    energy = target.double().pow(2).reshape(len(target), blocks, -1).sum((0, 2))
    return (err / energy.clamp(min=1e-30)).tolist()


class _ResidualMLP(nn.Module):
    """``linear(h) + down(gelu(up(h)))``: the ridge map plus a small MLP that starts at zero."""

    def __init__(self, w: torch.Tensor, hidden: int):
        super().__init__()
        d, m = w.shape[0] - 1, w.shape[1]
        self.linear = nn.Linear(d, m)
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, m)
        with torch.no_grad():
            self.linear.weight.copy_(w[:-1].T)
            self.linear.bias.copy_(w[-1])
            self.down.weight.zero_()
            self.down.bias.zero_()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(h) + self.down(nn.functional.gelu(self.up(h)))


def train_mlp(
    x: torch.Tensor,
    y: torch.Tensor,
    w: torch.Tensor,
    hidden: int,
    steps: int,
    batch: int,
    lr: float,
    seed: int,
) -> nn.Module:
    """Adam (cosine-decayed ``lr``) on minibatches of tokens; loss: squared error over the target energy."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    mlp = _ResidualMLP(w, hidden)
    optimizer = torch.optim.Adam(mlp.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    scale = y.pow(2).sum(1).mean()
    for _ in range(steps):
        idx = torch.randint(len(x), (min(batch, len(x)),), generator=generator)
        loss = (mlp(x[idx]) - y[idx]).pow(2).sum(1).mean() / scale
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    return mlp.eval()


def probe_errors(
    fit: ProbeData,
    held: ProbeData,
    blocks: int,
    neighbours: int = 4,
    ridge: float = 1e-3,
    mlp_hidden: int = 1024,
    mlp_steps: int = 600,
    mlp_batch: int = 1024,
    mlp_lr: float = 3e-3,
    seed: int = 0,
) -> dict[str, dict[str, list[float]]]:
    """Held-out (and fit) relative errors per target block of the three probes (module docstring)."""

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, t.shape[-1])

    x_fit, x_held, y_fit, y_held = flat(fit.h), flat(held.h), flat(fit.targets), flat(held.targets)
    w = ridge_fit(x_fit, y_fit, ridge)
    out = {
        "linear": {
            "held": relative_errors(ridge_apply(x_held, w), y_held, blocks),
            "fit": relative_errors(ridge_apply(x_fit, w), y_fit, blocks),
        }
    }
    if neighbours > 1:
        c_fit = flat(context_features(fit.h, fit.position_ids, neighbours))
        c_held = flat(context_features(held.h, held.position_ids, neighbours))
        wc = ridge_fit(c_fit, y_fit, ridge)
        out["context"] = {
            "held": relative_errors(ridge_apply(c_held, wc), y_held, blocks),
            "fit": relative_errors(ridge_apply(c_fit, wc), y_fit, blocks),
        }
    if mlp_steps > 0:
        mlp = train_mlp(x_fit, y_fit, w, mlp_hidden, mlp_steps, mlp_batch, mlp_lr, seed)
        with torch.no_grad():
            out["mlp"] = {
                "held": relative_errors(mlp(x_held), y_held, blocks),
                "fit": relative_errors(mlp(x_fit), y_fit, blocks),
            }
    return out


# -- the model: teacher K/V, the oracle passes and the probes' data ----------------------------------------------
def _teacher(model, ids: torch.Tensor, pos: torch.Tensor):
    """Layers < l once, then the teacher's upper layers one by one: the shared state, x_l, each upper layer's
    input, the teacher's final normed hidden states and its cache's K/V (with RoPE) per upper layer."""
    import dataclasses

    from transformers.cache_utils import DynamicCache

    base, l = model.model, model.config.num_key_value_layers
    prepared = base._prepare(ids, None, pos, None, None, False, ids.shape[1])
    x_l = base._run(base.layers[:l], prepared.hidden_states, prepared)
    cache = DynamicCache(config=model.config)
    with_cache = dataclasses.replace(prepared, cache=cache)
    x, inputs = x_l, []
    for layer in base.layers[l:]:
        inputs.append(x)
        x = base._run([layer], x, with_cache)
    kv = {j: (cache.layers[j].keys, cache.layers[j].values) for j in range(l, len(base.layers))}
    return prepared, x_l, inputs, base.norm(x), kv


def _teacher_queries(layer: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters that make a SwiftKV layer's query path the original one (q_proj, and Qwen3's q_norm)."""
    attn = layer.self_attn
    params = {f"self_attn.q_proj_swiftkv.{n}": p for n, p in attn.q_proj.named_parameters()}
    if hasattr(attn, "q_norm_swiftkv"):
        params.update({f"self_attn.q_norm_swiftkv.{n}": p for n, p in attn.q_norm.named_parameters()})
    return params


def _student(
    model, x_l, prepared, kv, teacher_kv, swap: set[int], teacher_queries: bool, exact=None
) -> torch.Tensor:
    """The student's final normed hidden states with layers in ``swap`` on the teacher's K/V (and queries); the
    other layers take exact K/V at the ``exact`` positions (a checkpoint with ``exact_kv_window``)."""
    base, l, g = model.model, model.config.num_key_value_layers, model.config.key_value_group_size
    x = x_l
    for layer in base.layers[l:]:
        j = layer.self_attn.layer_idx
        swapped = j in swap
        kwargs = dict(
            attention_mask=prepared.attention_mask,
            position_embeddings=prepared.position_embeddings,
            position_ids=prepared.position_ids,
            swiftkv_kv=teacher_kv[j] if swapped else kv[(j - l) // g],
            exact_kv_mask=None if swapped else exact,
        )
        params = _teacher_queries(layer) if swapped and teacher_queries else {}
        x = functional_call(layer, params, (x,), kwargs, strict=False) if params else layer(x, **kwargs)
    return base.norm(x)


def _targets(model, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The teacher's pre-RoPE keys and values of every upper layer, [rows, seq, (L - l) * 2 * d_kv]."""
    layers = model.model.layers[model.config.num_key_value_layers :]
    out = []
    for layer, x in zip(layers, inputs, strict=True):
        normed = layer.input_layernorm(x)
        out += [layer.self_attn.k_proj(normed), layer.self_attn.v_proj(normed)]
    return torch.cat(out, -1)


def _predicted(model, h: torch.Tensor) -> torch.Tensor:
    """The checkpoint's own K/V projections of ``h``, laid out like ``_targets`` (each member: its leader's)."""
    l, g, n = (
        model.config.num_key_value_layers,
        model.config.key_value_group_size,
        model.config.num_hidden_layers,
    )
    out = []
    for j in range(l, n):
        leader = model.model.layers[l + (j - l) // g * g].self_attn
        out += [leader.k_proj_swiftkv(h), leader.v_proj_swiftkv(h)]
    return torch.cat(out, -1)


def _recipe_of(checkpoint: Path, recipe: Path | None, overrides: list[str]):
    from .recipe import Recipe
    from .shipped import load_recipe_or_usage

    if recipe is not None:
        return load_recipe_or_usage(recipe, overrides)
    saved = read_provenance(checkpoint).get("recipe")
    if saved is None:
        raise UsageError(
            f"{checkpoint} records no distillation recipe (to resolve, pass --recipe with the data to use)"
        )
    if overrides:
        raise UsageError("key=value overrides need --recipe (to resolve, pass the recipe they apply to)")
    try:
        return Recipe.model_validate(saved)
    except ValueError as e:  # pydantic's ValidationError: a recipe of another toolkit version
        first = str(e).splitlines()[1] if len(str(e).splitlines()) > 1 else str(e)
        raise UsageError(
            f"{checkpoint}'s recorded recipe does not validate ({first}) (to resolve, pass --recipe)"
        ) from None


def _blocks(upper: range, block_layers: int) -> list[list[int]]:
    return [list(upper[i : i + block_layers]) for i in range(0, len(upper), block_layers)]


@torch.no_grad()
def diagnose(
    checkpoint: str | Path,
    out: str | Path | None = None,
    recipe: str | Path | None = None,
    overrides: list[str] = (),
    block_layers: int | None = None,
    fit_rows: int = 96,
    eval_rows: int | None = None,
    neighbours: int = 4,
    mlp_hidden: int = 1024,
    mlp_steps: int = 600,
    seed: int = 0,
) -> dict:
    """The oracle and probe tables of a SwiftKV checkpoint (module docstring), written to ``out`` if given.

    Data: the recipe's (``recipe``, else the one the distillation recorded in the checkpoint); probes are fitted
    on its first ``fit_rows`` training rows, everything is scored on its first ``eval_rows`` held-out rows
    (default: the ``log.eval_batches`` micro-batches the trainer evaluates, so the student's KL is the trainer's).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import swiftkv  # noqa: F401  (registers the SwiftKV model classes)

    from .data import build_datasets

    checkpoint = Path(checkpoint)
    config = read_config(checkpoint)
    if "num_key_value_layers" not in config:
        raise UsageError(
            f"{checkpoint} is not a SwiftKV checkpoint (to resolve, convert or distill it first)"
        )
    l, g, n = (
        config["num_key_value_layers"],
        config.get("key_value_group_size", 1),
        config["num_hidden_layers"],
    )
    if l >= n:
        raise UsageError(f"{checkpoint} has no SwiftKV layer (l = {l} of {n}); nothing to diagnose")
    if (
        min(fit_rows, neighbours, mlp_hidden) < 1
        or mlp_steps < 0
        or (block_layers or 1) < 1
        or (eval_rows or 1) < 1
    ):
        raise UsageError(
            "counts must be positive (to resolve, check --fit-rows, --limit, --neighbours, --mlp-*)"
        )
    cfg = _recipe_of(checkpoint, None if recipe is None else Path(recipe), list(overrides))
    block_layers = block_layers or g * math.ceil((n - l) / 5 / g)
    eval_rows = eval_rows or cfg.log.eval_batches * cfg.train.micro_batch_size
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.set_mode("student")
    train_rows, held_rows = build_datasets(cfg.data, tokenizer, config.get("max_position_embeddings"))
    upper = range(l, n)
    blocks = _blocks(upper, block_layers)
    variants = {"student": (set(), False), "all_kv": (set(upper), False), "all_kv_q": (set(upper), True)}
    for block in blocks:
        variants[f"kv_{block[0]}"] = (set(block), False)
        variants[f"kv_q_{block[0]}"] = (set(block), True)
    sums = {name: torch.zeros(5, dtype=torch.float64) for name in variants}
    batch = cfg.train.micro_batch_size

    def probe_data(rows, count: int, oracle: bool) -> tuple[ProbeData, torch.Tensor]:
        hs, positions, targets, predicted = [], [], [], []
        for i in range(0, min(count, len(rows)), batch):
            part = rows[i : min(i + batch, count)]
            ids, pos = part["input_ids"].long(), part["position_ids"].long()
            prepared, x_l, inputs, teacher, teacher_kv = _teacher(model, ids, pos)
            h = model.model.norm_swiftkv(x_l)
            hs.append(h), positions.append(pos), targets.append(_targets(model, inputs))
            predicted.append(_predicted(model, h))
            if oracle:
                kv = model.model.swiftkv_key_values(x_l, prepared)
                mask, exact = served_positions(  # the served positions
                    part["loss_mask"], pos, model.config.exact_kv_window, cfg.loss.exact_kv_replies
                )
                for name, (swap, queries) in variants.items():
                    student = _student(model, x_l, prepared, kv, teacher_kv, swap, queries, exact)
                    sums[name] += agreement_metrics(
                        student, teacher, model.lm_head, mask, cfg.loss.chunk_tokens, ids
                    )
        return ProbeData(torch.cat(hs), torch.cat(positions), torch.cat(targets)), torch.cat(predicted)

    held, held_predicted = probe_data(held_rows, eval_rows, oracle=True)
    fit, _ = probe_data(train_rows, fit_rows, oracle=False)
    metrics = {name: metrics_from_sums(s) for name, s in sums.items()}
    columns = 2 * len(upper)
    with torch.enable_grad():
        probes = probe_errors(
            fit, held, columns, neighbours, mlp_hidden=mlp_hidden, mlp_steps=mlp_steps, seed=seed
        )
    probes["checkpoint"] = {
        "held": relative_errors(held_predicted.flatten(0, 1), held.targets.flatten(0, 1), columns)
    }
    result = {
        "checkpoint": str(checkpoint),
        "num_layers": n,
        "num_key_value_layers": l,
        "group_size": g,
        "eval_rows": min(eval_rows, len(held_rows)),
        "fit_rows": min(fit_rows, len(train_rows)),
        "eval_tokens": metrics["student"]["tokens"],
        "fit_tokens": int(fit.h.shape[0] * fit.h.shape[1]),
        "neighbours": neighbours,
        "mlp": {"hidden": mlp_hidden, "steps": mlp_steps},
        "blocks": blocks,
        "oracle": metrics,
        "probes": probes,  # per upper layer j: [K_j, V_j] relative errors, in layer order
        "seconds": time.perf_counter() - t0,
    }
    if out is not None:
        out = Path(out)
        write_json_atomic(out / "diagnosis.json", result)
        tmp = out / f".diagnosis.md.tmp-{os.getpid()}"
        tmp.write_text("\n".join(report_lines(result)) + "\n")
        os.replace(tmp, out / "diagnosis.md")
    return result


def _kv_means(errors: list[float], upper: range, layers: list[int]) -> str:
    k = [errors[2 * (j - upper.start)] for j in layers]
    v = [errors[2 * (j - upper.start) + 1] for j in layers]
    return f"{sum(k) / len(k):.3f} / {sum(v) / len(v):.3f}"


def _name(block: list[int]) -> str:
    return f"{block[0]}–{block[-1]}" if len(block) > 1 else str(block[0])


def report_lines(result: dict) -> list[str]:
    """The oracle and probe tables in markdown."""
    oracle, l, n = result["oracle"], result["num_key_value_layers"], result["num_layers"]
    base = oracle["student"]["kl"]

    def row(name: str, kv: dict, kv_q: dict) -> str:
        def cell(m: dict) -> str:
            share = 1 - m["kl"] / base if base > 0 else 0.0
            return f"{m['kl']:.3f} | {share:.0%}"

        return f"| {name} | {cell(kv)} | {cell(kv_q)} |"

    lines = [
        f"# SwiftKV diagnosis: {result['checkpoint']}",
        "",
        f"l = {l} of {n} layers (group size {result['group_size']}); held-out: {result['eval_rows']} rows, "
        f"{result['eval_tokens']:,} counted tokens; probes fitted on {result['fit_rows']} training rows "
        f"({result['fit_tokens']:,} tokens). Student: KL {base:.3f}, top-1 {oracle['student']['top1_agreement']:.3f}, "
        f"ppl ×{oracle['student']['ppl_student'] / oracle['student']['ppl_teacher']:.3f}.",
        "",
        "Oracle: the teacher's own K/V in one block of SwiftKV layers (KL reached, share of the student's KL removed).",
        "",
        "| layers swapped | KL, teacher K/V | removed | KL, teacher K/V + queries | removed |",
        "|---|---|---|---|---|",
    ]
    for block in result["blocks"]:
        lines.append(row(_name(block), oracle[f"kv_{block[0]}"], oracle[f"kv_q_{block[0]}"]))
    lines.append(row(f"all ({l}–{n - 1})", oracle["all_kv"], oracle["all_kv_q"]))
    probes, upper = result["probes"], range(l, n)
    names = [("checkpoint", "checkpoint's K/V projections"), ("linear", "linear (ridge)")]
    names += [("mlp", f"linear + MLP ({result['mlp']['hidden']} hidden)")] * ("mlp" in probes)
    names += [("context", f"linear over {result['neighbours']} tokens")] * ("context" in probes)
    lines += [
        "",
        "Probes: held-out relative error of the teacher's pre-RoPE keys / values predicted from norm_swiftkv(x_l), "
        "mean over the layers of each block (fit error in parentheses, all layers).",
        "",
        "| predictor | " + " | ".join(f"{_name(b)} K / V" for b in result["blocks"]) + " | all K / V |",
        "|---|" + "---|" * (len(result["blocks"]) + 1),
    ]
    for key, label in names:
        held = probes[key]["held"]
        cells = [_kv_means(held, upper, b) for b in result["blocks"]]
        fit = f" ({_kv_means(probes[key]['fit'], upper, list(upper))})" if "fit" in probes[key] else ""
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {_kv_means(held, upper, list(upper))}{fit} |")
    return lines


def build_parser():
    from .check import IntermixedParser

    parser = IntermixedParser(
        prog="swiftkv diagnose",
        description="Where a SwiftKV student's error comes from: per-block oracle with the teacher's own K/V, "
        "and probes of how predictable the teacher's K/V are (forward passes only).",
        epilog=EPILOG,
    )
    add_model(parser, "checkpoint", help="SwiftKV checkpoint (a distillation's model/ or converted/ folder)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of --recipe")
    parser.add_argument(
        "--recipe", type=Path, help="recipe whose data to use (default: the checkpoint's own)"
    )
    parser.add_argument(
        "--block-layers", type=int, help="SwiftKV layers per oracle block (default: 5 blocks)"
    )
    parser.add_argument("--fit-rows", type=int, default=96, help="training rows the probes are fitted on")
    parser.add_argument("--neighbours", type=int, default=4, help="tokens the context probe sees (1: off)")
    parser.add_argument("--mlp-hidden", type=int, default=1024, help="hidden width of the MLP probe")
    parser.add_argument("--mlp-steps", type=int, default=600, help="Adam steps of the MLP probe (0: off)")
    parser.add_argument(
        "--exact-kv",
        type=int,
        metavar="W",
        help="instead: KL with exact K/V for the tokens that run every layer (prompt window W), forward only",
    )
    add_limit(
        parser,
        None,
        "held-out rows (default: the trainer's log.eval_batches x micro_batch_size); with --exact-kv, "
        "held-out conversations (default 32)",
    )
    add_out(parser, required=False, help="folder for diagnosis.{json,md} (default: print only)")
    return parser


@torch.no_grad()
def diagnose_exact_kv(
    checkpoint: str | Path, window: int, out: str | Path | None = None, limit: int = 32
) -> dict:
    """``distill.served.exact_kv_table`` of a checkpoint, written to ``out/exact_kv.{json,md}`` if given."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import swiftkv  # noqa: F401  (registers the SwiftKV model classes)

    from .served import exact_kv_lines, exact_kv_table

    checkpoint = Path(checkpoint)
    config = read_config(checkpoint)
    if config.get("num_key_value_layers", config["num_hidden_layers"]) >= config["num_hidden_layers"]:
        raise UsageError(f"{checkpoint} has no SwiftKV layer (to resolve, convert or distill it first)")
    if config.get("key_value_group_size", 1) > 1:
        raise UsageError(f"{checkpoint} uses AcrossKV groups; exact K/V need key_value_group_size 1")
    if window < 1 or limit < 1:
        raise UsageError("--exact-kv and --limit must be positive (to resolve, pass e.g. --exact-kv 32)")
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    table = exact_kv_table(model, tokenizer, window, limit)
    result = {"checkpoint": str(checkpoint), "window": window, "conversations": limit, "table": table}
    result["seconds"] = time.perf_counter() - t0
    if out is not None:
        out = Path(out)
        write_json_atomic(out / "exact_kv.json", result)
        tmp = out / f".exact_kv.md.tmp-{os.getpid()}"
        tmp.write_text("\n".join(exact_kv_lines(table, window)) + "\n")
        os.replace(tmp, out / "exact_kv.md")
    return result


def _diagnose(args) -> str:
    if args.exact_kv is not None:
        from .served import exact_kv_lines

        result = diagnose_exact_kv(args.checkpoint, args.exact_kv, args.out, args.limit or 32)
        return "\n".join(exact_kv_lines(result["table"], args.exact_kv))
    result = diagnose(
        args.checkpoint,
        args.out,
        args.recipe,
        args.overrides,
        args.block_layers,
        args.fit_rows,
        args.limit,
        args.neighbours,
        args.mlp_hidden,
        args.mlp_steps,
    )
    return "\n".join(report_lines(result))


def main(argv: list[str] | None = None) -> int:
    return run(_diagnose, build_parser(), argv)
