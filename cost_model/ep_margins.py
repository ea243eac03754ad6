"""The ep routing imbalance margins: a stated model of how many more routed rows the busiest rank of an
expert group receives than the group's mean, under dropless routing (`ep_imbalance_margins`).
`cost_model.activations` prices a spread MoE's routed storages with them; `Activations.policy_margins`
reads them under a recompute policy.
"""

from __future__ import annotations

import math

# The ep routing imbalance margins (`ep_imbalance_margins`): with experts spread over a group, the rows a
# rank's experts receive depend on the routing (no capacity limit: no token is dropped), so the busiest
# rank holds more than the mean over the group. Constants fitted by benchmarks/ep_routing.py (README,
# memory fidelity) on the rows every expert received in 148 untrained-router cases.
EP_SPREAD_SCALE = 0.00396  # s0: the per-layer spread at h = 1, below (exp of the fit's intercept, -5.53)
EP_SPREAD_EXPONENTS = (0.731, 0.306, -0.157, 0.172)  # of h, 1/b - 1/E, k, L (least squares on log spread)
EP_HELD_QUANTILE, EP_RERUN_QUANTILE = 0.95, 0.90  # c_held, c_rerun: the fewest cases beyond 5% and 10%
EP_SPREAD_WIDEST = 256  # the widest h fitted: wider models are priced at it (the fit's h^a does not extrapolate)


def ep_imbalance_margins(group: int, experts: int, top_k: int, hidden: int, layers: int, held_layers: int = 0,
                         rerun_layers: int = 0) -> tuple[float, float]:
    """(held, re-run): the busiest rank's routed rows over the expert group's mean, less 1, for an expert
    group of n = `group` ranks, each holding b = E / n of the E = `experts` experts (a contiguous block,
    runtime.experts), top-k routing, MoE input width h = `hidden` and L = `layers` MoE layers. A layer's
    rows on rank r are x_rl = rows_rl / mean_l - 1 of the group's mean; at random init they spread by

        s = s0 h^a (1/b - 1/E)^c k^d L^e      (the root mean square of x_rl over ranks and layers)

    (a wider h: the layers' outputs, shared within a sequence, outweigh the per-token embedding; more
    experts per rank average more loads; EP_SPREAD_SCALE, EP_SPREAD_EXPONENTS fitted by
    benchmarks/ep_routing.py: log s by least squares, residual sd 0.39, mostly between seeds). After the
    forward a rank holds all L layers' rows, so its excess is a mean over L layers whose max over n ranks
    is priced as c_held s sqrt(2 ln n) / sqrt(L); while one layer is re-run, the busiest of n L layer
    loads, c_rerun s sqrt(2 ln(n L)) (the expected max of m normals grows as sqrt(2 ln m)). c_held and
    c_rerun (EP_HELD_QUANTILE, EP_RERUN_QUANTILE) place them where the fewest fitted cases are beyond 5%
    and 10% of their busiest rank, under-pricing counted double. h is taken at most EP_SPREAD_WIDEST (the
    fit saw h <= 256 and over-prices h = 384 already), and neither margin exceeds what one rank can
    receive, n min(k, b) / k - 1 (each token's k slots go to k distinct experts). Under a policy that
    recomputes R of the layers, the mean is over the H layers that hold routed rows after the forward
    (`held_layers`: L - R under full recompute of R) and the max over the n R re-run layer loads
    (`rerun_layers`); 0: all L."""
    n = max(group, 2)
    b = max(experts // n, 1)
    a, c, d, e = EP_SPREAD_EXPONENTS
    width = min(hidden, EP_SPREAD_WIDEST)
    spread = EP_SPREAD_SCALE * width ** a * (1 / b - 1 / experts) ** c * top_k ** d * layers ** e
    most = n * min(top_k, b) / top_k - 1
    held_layers, rerun_layers = held_layers or layers, rerun_layers or layers
    held = EP_HELD_QUANTILE * spread * math.sqrt(2 * math.log(n) / held_layers)
    return min(held, most), min(EP_RERUN_QUANTILE * spread * math.sqrt(2 * math.log(n * rerun_layers)), most)
