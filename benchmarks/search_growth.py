"""What a deeper search does more of (issue 16): the whole search of `search_scaling.py` (GPT-3 shapes on
16x8xh100, global batch 128, sequence 2048, baselines off) at two depths, with the functions that grow with
depth wrapped while it runs. Each row is the process CPU time spent inside that function, outermost call only
(a price made by a fit check counts once, under the outer), and how many outermost calls; each figure the
minimum over `--repeat` searches (a shared machine).

    python benchmarks/search_growth.py [--layers 24 96] [--repeat 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import search_scaling as scaling  # noqa: E402  the same model, cluster, batch and sequence

import autoplan.cost_model.step as step  # noqa: E402
import autoplan.solver.context as context  # noqa: E402
import autoplan.solver.search as search  # noqa: E402
from autoplan.api import capture_model, search_plans  # noqa: E402
from autoplan.models import get_model_config  # noqa: E402


def _megatron(_ctx, _tp, _microbatch, variant="ilp", *args, **kwargs) -> bool:
    return variant != context.VARIANT_ILP


def _ilp(ctx, tp, microbatch, variant="ilp", *args, **kwargs) -> bool:
    return not _megatron(ctx, tp, microbatch, variant)


# (row, owner, function, which calls count): the rows of the table the benchmarks README keeps
WRAPPED = (
    ("Megatron retry blocks (their assignment, parts and block)", context.SearchContext, "block", _megatron),
    ("intra-op blocks (ILP solves, parts and blocks; cached look-ups)", context.SearchContext, "block", _ilp),
    ("prices (stage DPs, stage sums)", step.StepModel, "price", None),
    ("fit checks and the retries' memory floors", search, "_cannot_fit", None),
    ("fit checks and the retries' memory floors", search, "_over_floor", None),
    ("time floors", step.StepModel, "priced_above", None),
    ("the plan's per-op pass", search, "_plans", None),
)


class Timers:
    """Process CPU seconds and calls per row, outermost wrapped call only."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._inside = False

    def wrap(self, row: str, owner, name: str, counts) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if self._inside or (counts is not None and not counts(*args, **kwargs)):
                return inner(*args, **kwargs)
            self._inside, start = True, time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[row] = self.seconds.get(row, 0.0) + time.process_time() - start
                self.calls[row] = self.calls.get(row, 0) + 1
                self._inside = False

        setattr(owner, name, timed)


def measure(layers: int, repeat: int, timers: Timers) -> dict[str, tuple[float, int]]:
    """Per row: (the least seconds over `repeat` searches, calls in that search), and the whole search."""
    config = dataclasses.replace(get_model_config("gpt3-175b"), name=f"gpt3-{layers}l", num_layers=layers)
    graph = capture_model(config, scaling.SEQ)
    best: dict[str, tuple[float, int]] = {}
    for _ in range(repeat):
        timers.seconds, timers.calls = {}, {}
        start = time.process_time()
        search_plans(config, scaling.GPT_CLUSTER, scaling.GPT_BATCH, scaling.SEQ, graph=graph,
                     info=config.rule_info(), baselines=False)
        timers.seconds["whole search"], timers.calls["whole search"] = time.process_time() - start, 1
        for row, seconds in timers.seconds.items():
            if row not in best or seconds < best[row][0]:
                best[row] = (seconds, timers.calls[row])
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs=2, default=(24, 96))
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    timers = Timers()
    for row, owner, name, counts in WRAPPED:
        timers.wrap(row, owner, name, counts)
    shallow, deep = (measure(n, args.repeat, timers) for n in args.layers)
    print(f"| what | {args.layers[0]} layers | {args.layers[1]} layers |\n| --- | --- | --- |")
    for row in dict.fromkeys([r for r, *_ in WRAPPED] + ["whole search"]):
        cells = [f"{table[row][0] * 1e3:.1f} ms ({table[row][1]})" if row in table else "0 ms (0)"
                 for table in (shallow, deep)]
        print(f"| {row} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
