"""The rows each expert receives under dropless MoE routing, per layer: the data behind the ep routing
imbalance margins (`cost_model.activations.ep_imbalance_margins`), their fit, and their errors.

    python benchmarks/ep_routing.py          # both grids, fit and errors (about 20 minutes on 2 loaded cores)
    python benchmarks/ep_routing.py --from-json benchmarks/data/ep_routing.json benchmarks/data/ep_routing_held_out.json

A dropless run routes every (token, slot) pair; under ep a rank's experts are a contiguous block of
E / ep of them (`runtime.experts`), and its routed-row storages are in proportion to the rows that block
receives. Routing is per token and does not depend on the mesh (the ep runtime equals one process of
the same model), so one process of the zoo model, with the runtime's seeded init
(`runtime.init.init_parameters`) and the ep group's tokens (ep x microbatch sequences), gives every
rank's rows of every layer: a hook on each router counts its top-k choices.

Fitted grid (untrained routers, random init, random tokens; 37 shapes x 4 seeds, ep 2, 4 and 8 where
they divide E: 148 cases): Mixtral-style 4 layers, hidden 256, 8 experts, top-2, 2 sequences of 1024
tokens a rank, vocabulary 1024, float32, and one change at a time: 8 or 2 layers, 4 or 16 experts,
top-1, hidden 64, 1 sequence of 256, vocabulary 128 or 8192, bfloat16 autocast, a DeepSeekMoE-style
layout (16 fine-grained experts, top-4, 2 shared experts, a dense first layer), a tiny one (2 layers,
hidden 64, 4 experts, 4 sequences of 64, vocabulary 128). Held-out grid: other shapes (6 layers, hidden
128, 512 tokens, vocabulary 512; top-3; 16 experts top-1; hidden 192 with 3 layers and 2048 tokens; a
5-layer DeepSeekMoE-style; hidden 384; the tiny one under bfloat16) and other seeds: 80 cases.

Per case: x_rl = rows_rl / mean_l - 1 of each rank r and layer l; the spread s (its root mean square),
held (max_r mean_l x_rl: all layers held) and re-run (max_rl x_rl). `fit` gives the margins' constants;
`byte_errors` the plan's error against the busiest rank in bytes, from the cost model's bytes at the
mean and routed bytes of the case's plan (recompute none: held; full: while a layer is re-run).
Writes benchmarks/out/ep_routing.json and ep_routing_held_out.json (expert loads per layer per case).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
from pathlib import Path

import torch

OUT = Path(__file__).parent / "out"


def grid(held_out: bool = False) -> list[dict]:
    """(config fields, tokens per rank, seed, dtype) of each measured case (module docstring); `held_out`:
    other shapes and seeds, to check the margins fitted on the first grid."""
    if held_out:
        base = dict(family="mixtral", layers=6, hidden=128, experts=8, top_k=2, seq=512, microbatch=2,
                    vocab=512, dtype="float32")
        variants = [dict(), dict(top_k=3), dict(experts=16, top_k=1), dict(hidden=192, layers=3, seq=2048, microbatch=1),
                    dict(family="deepseek", experts=8, top_k=2, layers=5), dict(hidden=384, vocab=2048),
                    dict(layers=2, hidden=64, experts=4, seq=64, microbatch=4, vocab=128, dtype="bfloat16")]
        return [{**base, **v, "seed": seed} for v in variants for seed in range(10, 14)]
    base = dict(family="mixtral", layers=4, hidden=256, experts=8, top_k=2, seq=1024, microbatch=2,
                vocab=1024, dtype="float32")
    variants = [dict(), dict(layers=8), dict(layers=2), dict(experts=4), dict(experts=16), dict(top_k=1),
                dict(hidden=64), dict(seq=256, microbatch=1), dict(vocab=128), dict(vocab=8192),
                dict(dtype="bfloat16"), dict(family="deepseek", experts=16, top_k=4),
                dict(hidden=64, layers=2, experts=4, seq=64, microbatch=4, vocab=128)]
    return [{**base, **v, "seed": seed} for v in variants for seed in range(4)]


def model_config(case: dict):
    from autoplan.models.config import ModelConfig

    c = case
    shape = dict(num_layers=c["layers"], hidden=c["hidden"], heads=max(c["hidden"] // 32, 2),
                 kv_heads=max(c["hidden"] // 64, 1), vocab=c["vocab"], max_seq=c["seq"])
    if c["family"] == "deepseek":  # fine-grained: narrow experts, 2 shared, the first layer dense
        return ModelConfig("routing-deepseek", "moe", ffn_hidden=c["hidden"] // 2, experts=c["experts"],
                           top_k=c["top_k"], shared_experts=2, dense_layers=1, dense_ffn_hidden=2 * c["hidden"],
                           **shape)
    return ModelConfig("routing-mixtral", "moe", ffn_hidden=3 * c["hidden"] // 2, experts=c["experts"],
                       top_k=c["top_k"], **shape)


def expert_loads(case: dict, ep: int) -> list[list[int]]:
    """Rows each expert receives in each MoE layer, over the ep group's tokens (ep x microbatch
    sequences), one forward of the seeded model."""
    from autoplan.models import build_model
    from autoplan.models.layers import MoEFeedForward
    from autoplan.runtime.init import init_parameters

    config = model_config(case)
    torch.manual_seed(case["seed"])
    model = init_parameters(build_model(config, device="cpu"), case["seed"], config.num_layers)
    loads: list[list[int]] = []

    def count(module, args, output):
        top = output.topk(module_k[module], dim=-1).indices
        loads.append(torch.bincount(top.flatten(), minlength=output.shape[-1]).tolist())

    module_k = {}
    for m in model.modules():
        if isinstance(m, MoEFeedForward):
            module_k[m.router] = m.top_k
            m.router.register_forward_hook(count)
    gen = torch.Generator().manual_seed(1000 + case["seed"])
    tokens = torch.randint(0, config.vocab, (ep * case["microbatch"], case["seq"]), generator=gen)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=case["dtype"] == "bfloat16"):
        model(tokens)
    return loads


def rank_excess(loads: list[list[int]], ep: int) -> list[list[float]]:
    """x_rl: each layer's rows on each of the ep ranks (contiguous expert blocks) over the layer's mean, less 1."""
    found = []
    for layer in loads:
        block = len(layer) // ep
        rows = [sum(layer[r * block:(r + 1) * block]) for r in range(ep)]
        mean = sum(rows) / ep
        found.append([n / mean - 1 for n in rows])
    return found


def case_statistics(row: dict) -> dict:
    """A case's per-layer spread s (the root mean square of x_rl over ranks and layers), held excess
    (max_r mean_l x_rl: all L layers held) and re-run excess (max_rl x_rl: any layer may be re-run)."""
    x = rank_excess(row["loads"], row["ep"])
    values = [v for layer in x for v in layer]
    held = max(statistics.mean(layer[r] for layer in x) for r in range(row["ep"]))
    return {"spread": math.sqrt(statistics.mean(v * v for v in values)), "held": held,
            "rerun": max(values), "layers": len(x)}


def _features(row: dict) -> list[float]:
    """log of h (at most EP_SPREAD_WIDEST), 1/b - 1/E, k, L: the spread's regressors
    (`cost_model.activations.ep_imbalance_margins`)."""
    from autoplan.cost_model.ep_margins import EP_SPREAD_WIDEST

    n, experts = row["ep"], row["experts"]
    return [math.log(min(row["hidden"], EP_SPREAD_WIDEST)), math.log(1 / (experts // n) - 1 / experts), math.log(row["top_k"]),
            math.log(len(row["loads"]))]


def fit(rows: list[dict]) -> dict:
    """EP_SPREAD_SCALE and EP_SPREAD_EXPONENTS (least squares on log s), then EP_HELD_QUANTILE and
    EP_RERUN_QUANTILE: on a 0.05 grid, the fewest cases beyond 5% (under-pricing counted double) plus
    five times those beyond 10%, by `byte_errors`."""
    import numpy as np

    design = np.array([[1.0, *_features(r)] for r in rows])
    logs = np.log([case_statistics(r)["spread"] for r in rows])
    coef, *_ = np.linalg.lstsq(design, logs, rcond=None)
    found = {"scale": float(math.exp(coef[0])), "exponents": [float(c) for c in coef[1:]],
             "residual_sd": float((logs - design @ coef).std())}
    for i, key in ((0, "held"), (1, "rerun")):
        def score(c: float) -> int:
            errors = [e[i] for e in byte_errors(rows, lambda r: _modelled(r, found, c, c))]
            return sum(abs(e) > 0.05 for e in errors) + 2 * sum(e < -0.05 for e in errors) + 5 * sum(
                abs(e) > 0.10 for e in errors)
        found[key] = min((round(0.5 + 0.05 * j, 2) for j in range(31)), key=score)
    return found


def _modelled(row: dict, found: dict, c_held: float, c_rerun: float) -> tuple[float, float]:
    n, layers, k = row["ep"], len(row["loads"]), row["top_k"]
    spread = found["scale"] * math.exp(sum(a * f for a, f in zip(found["exponents"], _features(row))))
    most = n * min(k, row["experts"] // n) / k - 1  # all a rank can receive (`ep_imbalance_margins`)
    return (min(c_held * spread * math.sqrt(2 * math.log(n) / layers), most),
            min(c_rerun * spread * math.sqrt(2 * math.log(n * layers)), most))


def margins_now(row: dict) -> tuple[float, float]:
    """The cost model's margins for a case (`ep_imbalance_margins`)."""
    from autoplan.cost_model.ep_margins import ep_imbalance_margins

    return ep_imbalance_margins(row["ep"], row["experts"], row["top_k"], row["hidden"], len(row["loads"]))


@functools.cache
def _bytes(key: tuple) -> tuple[float, float]:
    """(bytes at the mean, routed bytes at the mean) of a case's plan under `policy` on its busiest rank's
    measure: held after the forward ("none") or while a layer is re-run ("full")."""
    from autoplan.api import capture_model, plan_from_assignment
    from autoplan.cluster import parse_cluster
    from autoplan.cost_model.memory import plan_activation_bytes, plan_activations
    from autoplan.mesh import MeshShape

    case, policy = dict(key[:-1]), key[-1]
    config, i = model_config(case), int(policy == "full")
    graph = capture_model(config, case["seq"], case["dtype"])
    plan = plan_from_assignment(graph, config, parse_cluster(f"{case['ep']}xcpu"), MeshShape(dp=1, ep=case["ep"]),
                                {}, case["microbatch"], 1, 0, policy, dtype=case["dtype"])
    info = config.rule_info()
    mean, priced = plan_activation_bytes(plan, graph, info, False)[i], plan_activation_bytes(plan, graph, info)[i]
    return mean, (priced - mean) / plan_activations(plan, graph, info)[0].margins[i]


def byte_errors(rows: list[dict], margins) -> list[tuple[float, float]]:
    """(held, re-run) error of the plan's price against each case's busiest rank, predicted / measured - 1,
    with `margins(row)` -> (held, re-run): the busiest rank holds the bytes at the mean plus the routed
    bytes times its excess (the mean's price is exact: benchmarks/memory_fidelity.py, the mean of the ranks)."""
    found = []
    for row in rows:
        stats, m = case_statistics(row), margins(row)
        shape = tuple(sorted((k, v) for k, v in row.items() if k not in ("loads", "seed")))
        pair = []
        for i, (policy, excess) in enumerate((("none", stats["held"]), ("full", stats["rerun"]))):
            mean, routed = _bytes((*shape, policy))
            pair.append((mean + routed * m[i]) / (mean + routed * excess) - 1)
        found.append(tuple(pair))
    return found


def describe(errors: list[float]) -> str:
    return (f"{sum(abs(e) <= 0.05 for e in errors)} of {len(errors)} within 5%, {sum(abs(e) <= 0.10 for e in errors)} "
            f"within 10%, from {min(errors):+.1%} to {max(errors):+.1%} (median {statistics.median(errors):+.1%})")


def report(rows: list[dict], name: str) -> None:
    """The errors of the fixed margins before (0.25 held, 0.35 re-run) and of `ep_imbalance_margins`."""
    for label, margins in (("before (0.25, 0.35)", lambda r: (0.25, 0.35)), ("now", margins_now)):
        errors = byte_errors(rows, margins)
        for i, what in ((0, "held"), (1, "re-run")):
            print(f"{name:9s} {label:20s} {what:7s} {describe([e[i] for e in errors])}")
        for n in (2, 4, 8):
            sub = [e for r, e in zip(rows, errors) if r["ep"] == n]
            if sub and label == "now":
                print(f"{'':9s} {'':20s} ep{n}: held {describe([e[0] for e in sub])}; re-run {describe([e[1] for e in sub])}")


def measure(held_out: bool) -> list[dict]:
    rows = []
    for case in grid(held_out):
        for ep in (2, 4, 8):
            if case["experts"] % ep == 0:
                rows.append({**case, "ep": ep, "loads": expert_loads(case, ep)})
                print(case, f"ep {ep}: re-run excess {case_statistics(rows[-1])['rerun']:+.3f}", flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / f"ep_routing{'_held_out' * held_out}.json").write_text(json.dumps({"rows": rows}) + "\n")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-json", nargs=2, metavar=("FIT", "HELD_OUT"), help="saved runs of both grids")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    if args.from_json:
        fitted, held_out = (json.loads(Path(p).read_text())["rows"] for p in args.from_json)
    else:
        fitted, held_out = measure(False), measure(True)
    found = fit(fitted)
    print(json.dumps(found))
    report(fitted, "fitted")
    report(held_out, "held-out")


if __name__ == "__main__":
    main()
