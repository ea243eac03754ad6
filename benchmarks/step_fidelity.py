"""Step-time fidelity: the step time each plan predicts against the step time it runs, on this machine.

    python benchmarks/step_fidelity.py                       # both families, every plan (under 10 minutes)
    python benchmarks/step_fidelity.py --quick               # a smoke run: 4 plans, 2 rounds x 2 steps
    python benchmarks/step_fidelity.py --families llama --rounds 4 --steps 5
    python benchmarks/step_fidelity.py --profile p.json      # price with this profile instead of a fresh one

What a careful user would do, on 2 gloo ranks (issue 20):

    profile     a fresh `torchrun --nproc-per-node 2 -m autoplan profile` (GEMMs, copy bandwidth, launch
                floor, fresh-allocation copies by size, causal SDPA, eager dispatch per kernel, on both
                ranks at once, the slower rank's time kept; every collective over both ranks, what
                a blocking one costs between compute beyond that (`collective_sync_s`) and what an
                overlapped one costs the compute beside it (`overlap_cost`); not FSDP2's
                unit cost, `--fsdp-units`, which still aborts at exit now and then),
                `--quick` with --quick
    predicted   each plan priced with that profile by the code `autoplan estimate --profile` runs
                (`cost_model.compute.calibrate`, then `api.estimate`, or `api.plan_from_assignment` for a
                given tp assignment); float32, the dtype the CPU profile measures
    plans       per family, `plan_specs`: dp 2 with ZeRO 0 / 1 / 2 / 3, more microbatches, recompute
                (selective, full), tp 2 Megatron / with sequence parallelism / the solver's own assignment,
                cp 2, pp 2 (1F1B), and the plan `autoplan search --profile` picks (`api.search_plans`)
    measured    every plan compiled by `autoplan.parallelize` in one pair of fresh processes per family
                (gloo, one CPU thread each, as torchrun gives), AdamW; `--warmup-rounds` discarded rounds of
                one step per plan (the processes' heaps grow to hold every plan's temporaries, and a step
                that grows them pays the new pages' faults, which a process training one plan pays once);
                then timed in `--rounds` rounds that rotate the plans' order, each round one discarded step
                and `--steps` timed steps per plan, each after a barrier; a step's time is the slowest
                rank's wall time; the measured step is the median
    malloc      both the profile and the ranks under GLIBC_TUNABLES=KEPT_PAGES, as the README advises for
                training on a CPU (glibc's default maps, unmaps and trims the steps' large temporaries, whose
                pages are then faulted in again each step: a Llama layer ran 5.6% slower, and the profile's
                loops never see it); `--default-malloc` runs both under the default
    breakdown   measured (medians, the slowest rank's steps): the CPU seconds of the step (the steadier
                figure on a loaded machine: wall time there is CPU time stretched by the other jobs),
                the main thread's share of them (the rest: gloo's threads), the wait for the gradient sync after backward (`GradSync.exposed_s`), the optimizer
                step, the process's minor page faults in thousands (a step far above 0 grew its heap);
                predicted: the plan's compute / communication / bubble / optimizer

Families: a small Llama (4 layers, hidden 384, 6 heads, 2 kv heads, SwiGLU 1024, vocabulary 4096) and a
small GPT (4 layers, hidden 384, 6 heads, FFN 1536, vocabulary 4096); global batch 8 x 256 tokens. Per
family: Spearman's rho of predicted against measured, the median |error| (error = predicted / measured -
1), and the search's regret (its plan's measured step over the fastest measured step, - 1). The machine's
load average is recorded with every family: on a shared machine the timings are only as good as it is
quiet. Results are written as they come (atomic replaces): benchmarks/out/step_fidelity.json (the
families done so far; a family in progress as its rounds end), and a PNG of predicted against measured
(benchmarks/out/step_fidelity.png, with matplotlib). `--from-json FILE` re-prints a saved run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from json_out import write_json  # noqa: E402
from runtime_overhead import _free_port, join_gloo  # noqa: E402

OUT = Path(__file__).parent / "out"
WORLD, SEQ, BATCH, SEED, LR, DTYPE = 2, 256, 8, 0, 1e-4, "float32"
CLUSTER = f"1x{WORLD}xcpu"


def families() -> dict:
    """The two model families, sized so a step takes about a second on one CPU thread per rank."""
    from autoplan.models.config import ModelConfig

    shape = dict(num_layers=4, hidden=384, heads=6, vocab=4096, max_seq=SEQ)
    return {"llama": ModelConfig("fid-llama", "llama", kv_heads=2, ffn_hidden=1024, **shape),
            "gpt": ModelConfig("fid-gpt", "gpt", kv_heads=6, ffn_hidden=1536, **shape)}


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """One configuration to price and run: mesh degrees, microbatch size, ZeRO, recompute, and the tp
    assignment ("solver": the intra-op solver's, as `estimate`; "megatron" / "megatron-sp": Megatron's,
    without / with sequence parallelism, `solver.intra_op.megatron_assignment`)."""

    name: str
    degrees: tuple[tuple[str, int], ...]
    microbatch_size: int
    zero_stage: int = 0
    recompute: str = "none"
    assignment: str = "solver"

    @property
    def mesh(self):
        from autoplan.mesh import MeshShape

        return MeshShape(**dict(self.degrees))


def plan_specs(quick: bool = False) -> list[PlanSpec]:
    """The plans every family runs (module docstring); `quick`: four of them."""
    dp, tp, cp, pp = (("dp", 2),), (("tp", 2),), (("cp", 2),), (("pp", 2),)
    half = BATCH // WORLD
    specs = [PlanSpec("dp2 zero0", dp, half), PlanSpec("dp2 zero1", dp, half, 1),
             PlanSpec("dp2 zero2", dp, half, 2), PlanSpec("dp2 zero3", dp, half, 3),
             PlanSpec("dp2 zero0 4 microbatches", dp, 1), PlanSpec("dp2 zero1 2 microbatches", dp, half // 2, 1),
             PlanSpec("dp2 zero0 selective", dp, half, 0, "selective"),
             PlanSpec("dp2 zero0 full", dp, half, 0, "full"),
             PlanSpec("tp2 megatron", tp, BATCH, 0, "none", "megatron"),
             PlanSpec("tp2 megatron sp", tp, BATCH, 0, "none", "megatron-sp"),
             PlanSpec("tp2 solver", tp, BATCH), PlanSpec("cp2", cp, BATCH // 2),
             PlanSpec("pp2 1f1b", pp, BATCH // 4)]
    if quick:
        keep = ("dp2 zero0", "dp2 zero1", "tp2 solver", "pp2 1f1b")
        specs = [s for s in specs if s.name in keep]
    return specs


# ------------------------------------------------------------------------------ profile and plans


# glibc's malloc as a CPU training process should run (README, "Training on a CPU"): no block of its own mapping,
# the heap never trimmed, so a step's large temporaries reuse pages already faulted in. Read at process start only.
KEPT_PAGES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967295:glibc.malloc.top_pad=268435456"


def keep_freed_pages(default_malloc: bool) -> str:
    """Set GLIBC_TUNABLES to KEPT_PAGES for the processes this run starts (the profile's, the ranks'), unless
    `default_malloc` or the caller set it; returns what they run under (recorded with the results)."""
    if default_malloc or not sys.platform.startswith("linux"):
        return os.environ.get("GLIBC_TUNABLES", "default")
    os.environ.setdefault("GLIBC_TUNABLES", KEPT_PAGES)
    return os.environ["GLIBC_TUNABLES"]


def fresh_profile(path: Path, quick: bool) -> None:
    """`torchrun --nproc-per-node 2 -m autoplan profile -o path`, as a user runs it."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun) if torchrun.exists() else "torchrun", "--nproc-per-node", str(WORLD),
               "--master-port", str(_free_port()), "-m", "autoplan", "profile", "-o", str(path)]
    subprocess.run(command + (["--quick"] if quick else []), check=True, stdout=subprocess.DEVNULL)


def calibrated(profile):
    """The cluster and efficiency `estimate --profile` prices with (`cost_model.compute.calibrate`)."""
    from autoplan.cluster import parse_cluster
    from autoplan.cost_model.compute import calibrate

    return calibrate(parse_cluster(CLUSTER), None, profile, "auto", DTYPE)


def price(config, spec: PlanSpec, profile, graph):
    """`spec` priced with `profile`: `estimate` for the solver's assignment, else `plan_from_assignment`
    with Megatron's, on the calibrated cluster (the same calibration `estimate` applies)."""
    from autoplan.api import estimate, plan_from_assignment
    from autoplan.solver.intra_op import megatron_assignment
    from autoplan.strategies import default_registry

    mesh = spec.mesh
    if spec.assignment == "solver":
        return estimate(config, CLUSTER, BATCH, SEQ, mesh=mesh, microbatch_size=spec.microbatch_size,
                        zero_stage=spec.zero_stage, recompute=spec.recompute, dtype=DTYPE, profile=profile,
                        graph=graph)
    cluster, efficiency = calibrated(profile)
    registry = default_registry()
    chosen = megatron_assignment(graph, registry, mesh.tp, config.rule_info(), spec.assignment == "megatron-sp")
    return plan_from_assignment(graph, config, cluster, mesh, chosen, spec.microbatch_size,
                                BATCH // (spec.microbatch_size * mesh.batch_shards), spec.zero_stage, spec.recompute,
                                registry=registry, dtype=DTYPE, efficiency=efficiency)


def searched(config, profile, graph):
    """The plan `autoplan search --profile` picks for this model and batch (`api.search_plans`)."""
    from autoplan.api import search_plans

    return search_plans(config, CLUSTER, BATCH, SEQ, dtype=DTYPE, profile=profile, graph=graph,
                        baselines=False).plans[0]


def configuration_key(plan) -> tuple:
    """What makes two plans run alike: mesh, batch split, ZeRO, recompute, schedule, stages, strategies."""
    strategies = tuple(sorted((op.node, op.strategy) for op in plan.ops))
    return (str(plan.mesh), plan.microbatch_size, plan.num_microbatches, plan.zero_stage, plan.recompute,
            plan.schedule, tuple(plan.stages), strategies)


def family_plans(config, profile, quick: bool) -> tuple[dict, str]:
    """{name: Plan} of `plan_specs`, with the search's plan added unless it is one of them, and the
    name of the search's plan."""
    from autoplan.api import capture_model

    graph = capture_model(config, SEQ, DTYPE)
    plans = {spec.name: price(config, spec, profile, graph) for spec in plan_specs(quick)}
    chosen = searched(config, profile, graph)
    for name, plan in plans.items():
        if configuration_key(plan) == configuration_key(chosen):
            return plans, name
    plans["search"] = chosen
    return plans, "search"


# ------------------------------------------------------------------------------ the ranks


class TimedOptimizer:
    """The optimizer's `step`, timed: seconds of the last step in `last_s`."""

    def __init__(self, optimizer) -> None:
        self.optimizer, self.last_s = optimizer, 0.0
        inner = optimizer.step

        def step(*args, **kwargs):
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            self.last_s = time.perf_counter() - start
            return out

        optimizer.step = step  # the instance's step, so the program's checks still see its class


def _page_faults() -> int:
    """This process's minor page faults so far (pages the kernel handed it on first touch)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _one_step(program, optimizer: TimedOptimizer, tokens, targets) -> dict[str, float]:
    dist.barrier()
    start, start_cpu, start_thread, faults = time.perf_counter(), time.process_time(), time.thread_time(), _page_faults()
    program.train_step(tokens, targets, optimizer.optimizer)
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    thread = time.thread_time() - start_thread  # the main thread's: cpu less gloo's threads
    sync = program.grad_sync.exposed_s() if program.grad_sync is not None else 0.0
    return {"step_s": wall, "cpu_s": cpu, "thread_s": thread, "sync_wait_s": sync, "optimizer_s": optimizer.last_s,
            "page_faults": _page_faults() - faults}


def _rotated(order: list[str], r: int) -> list[str]:
    return order[r % len(order):] + order[:r % len(order)]


def _warm_up(programs: dict, optimizers: dict, tokens, targets, rounds: int) -> None:
    """`rounds` discarded rounds of one step per plan, in the timed rounds' rotated orders: with every plan
    in one process, its heap grows as the plans' temporaries interleave in new orders, and each step that
    grows it pays the new pages' first-touch faults (0.1-0.5 s of system time in a step; a process
    training one plan reaches its steady heap in a step or two)."""
    order = list(programs)
    for r in range(rounds):
        for name in _rotated(order, r):
            _one_step(programs[name], optimizers[name], tokens, targets)


def _rank(rank: int, port: int, config, plans: dict, rounds: int, steps: int, partial: str,
          warmup: int) -> None:
    """One rank: every plan compiled, `warmup` discarded rounds (`_warm_up`), then rounds of (one
    discarded step + `steps` timed) per plan."""
    join_gloo(rank, WORLD, port)
    import autoplan
    from autoplan.models import build_model

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(config.vocab, (BATCH, SEQ), generator=gen)
    targets = torch.randint(config.vocab, (BATCH, SEQ), generator=gen)
    programs, optimizers = {}, {}
    for name, plan in plans.items():
        programs[name] = autoplan.parallelize(build_model(config), plan.cluster, plan, config=config, seed=SEED)
        optimizers[name] = TimedOptimizer(programs[name].make_optimizer(torch.optim.AdamW, lr=LR))
    _warm_up(programs, optimizers, tokens, targets, warmup)
    samples: dict[str, list[dict]] = {name: [] for name in plans}
    order = list(plans)
    for r in range(rounds):
        for name in _rotated(order, r):
            _one_step(programs[name], optimizers[name], tokens, targets)  # discarded
            samples[name] += [_one_step(programs[name], optimizers[name], tokens, targets) for _ in range(steps)]
        slowest = _slowest_rank(samples)
        if rank == 0:
            write_json(Path(partial), {"rounds_done": r + 1, "samples": slowest})
    dist.destroy_process_group()


def _slowest_rank(samples: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Each step's figures from the rank whose step took longest (a step ends when its last rank does)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, samples)
    return {name: [max((g[name][i] for g in gathered), key=lambda s: s["step_s"]) for i in range(len(rows))]
            for name, rows in samples.items()}


def measure(config, plans: dict, rounds: int, steps: int, partial: Path, warmup: int = 0) -> dict[str, list[dict]]:
    """Per plan, its timed steps' figures (the slowest rank's), from fresh gloo processes. A rank that dies
    after every round was written (gloo's threads now and then abort a process at exit: "terminate called
    without an active exception") loses nothing: its figures are read back with a warning."""
    partial.unlink(missing_ok=True)  # this run's own rounds only
    try:
        mp.start_processes(_rank, args=(_free_port(), config, plans, rounds, steps, str(partial), warmup),
                           nprocs=WORLD, start_method="spawn")
    except mp.ProcessExitedException as exc:
        done = json.loads(partial.read_text()).get("rounds_done", 0) if partial.exists() else 0
        if done < rounds:
            raise
        print(f"warning: {exc} after all {rounds} rounds were written; their figures stand", file=sys.stderr)
    return json.loads(partial.read_text())["samples"]


# ------------------------------------------------------------------------------ the figures


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's r of the ranks (ties get their mean rank)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def summarize(plans: dict, samples: dict[str, list[dict]], search_name: str) -> dict:
    """Rows (predicted, measured median, error, breakdowns) and the family's rho, median |error|, regret."""
    rows = []
    for name, plan in plans.items():
        steps = samples[name]
        measured = statistics.median(s["step_s"] for s in steps)
        t = plan.predicted.time
        rows.append({"plan": name, "configuration": plan_text(plan), "predicted_s": plan.predicted.step_time_s,
                     "measured_s": measured, "error": plan.predicted.step_time_s / measured - 1,
                     "predicted_breakdown_s": {"compute": t.compute_s, "communication": t.communication_s,
                                               "bubble": t.bubble_s, "optimizer": t.optimizer_s},
                     "measured_breakdown_s": {k: statistics.median(s.get(k, float("nan")) for s in steps)
                                              for k in ("cpu_s", "thread_s", "sync_wait_s", "optimizer_s", "page_faults")},
                     "steps": len(steps), "search": name == search_name})
    fastest = min(r["measured_s"] for r in rows)
    searched_s = next(r["measured_s"] for r in rows if r["search"])
    return {"rows": rows, "spearman": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
            "median_abs_error": statistics.median(abs(r["error"]) for r in rows),
            "search_plan": search_name, "search_regret": searched_s / fastest - 1,
            "search_rank": 1 + sorted(r["measured_s"] for r in rows).index(searched_s)}


def plan_text(plan) -> str:
    return (f"{plan.mesh}, ZeRO-{plan.zero_stage}, mbs {plan.microbatch_size} x {plan.num_microbatches}, "
            f"{plan.recompute}")


def print_family(family: str, result: dict) -> None:
    print(f"\n{family}: {result['model']['name']}  (load average {result['load_avg_before']} -> {result['load_avg_after']})")
    print(f"{'plan':26s} {'pred s':>7s} {'meas s':>7s} {'error':>7s}  {'compute':>7s} {'comm':>6s} {'bubble':>6s} "
          f"{'optim':>6s}  {'cpu s':>6s} {'main':>6s} {'sync w':>6s} {'optim':>6s} {'flt k':>5s}")
    for r in sorted(result["rows"], key=lambda r: r["measured_s"]):
        p, m = r["predicted_breakdown_s"], r["measured_breakdown_s"]
        mark = " <- search" if r["search"] else ""
        print(f"{r['plan']:26s} {r['predicted_s']:7.3f} {r['measured_s']:7.3f} {r['error']:+7.1%}  "
              f"{p['compute']:7.3f} {p['communication']:6.3f} {p['bubble']:6.3f} {p['optimizer']:6.3f}  "
              f"{m['cpu_s']:6.3f} {m.get('thread_s', float('nan')):6.3f} {m['sync_wait_s']:6.3f} "
              f"{m['optimizer_s']:6.3f} {m.get('page_faults', float('nan')) / 1e3:5.1f}{mark}")
    print(f"Spearman rho {result['spearman']:.3f}, median |error| {result['median_abs_error']:.1%}, search's plan "
          f"({result['search_plan']}) measured {result['search_rank']} of {len(result['rows'])}, regret "
          f"{result['search_regret']:+.1%}")


def draw(results: dict, path: Path) -> str:
    """Predicted against measured per family (log-log, y = x dashed); a note when matplotlib is absent."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG"
    fig, ax = plt.subplots(figsize=(6, 6))
    values = []
    for family, result in results.items():
        xs, ys = [r["measured_s"] for r in result["rows"]], [r["predicted_s"] for r in result["rows"]]
        ax.scatter(xs, ys, label=f"{family} (rho {result['spearman']:.2f})")
        values += xs + ys
    lo, hi = min(values) * 0.8, max(values) * 1.25
    ax.plot([lo, hi], [lo, hi], "k--", lw=1)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step (s)",
           ylabel="predicted step (s)", title=f"step time on {WORLD} gloo ranks (CPU)")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return f"wrote {path}"


def run_family(family: str, config, profile, args, partial: Path) -> dict:
    load_before = [round(x, 2) for x in os.getloadavg()]
    plans, search_name = family_plans(config, profile, args.quick)
    samples = measure(config, plans, args.rounds, args.steps, partial, args.warmup_rounds)
    result = summarize(plans, samples, search_name)
    return {"model": dataclasses.asdict(config), "load_avg_before": load_before,
            "load_avg_after": [round(x, 2) for x in os.getloadavg()], **result}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 plans per family, a quick profile, 2 rounds x 2 steps")
    parser.add_argument("--families", nargs="+", choices=("llama", "gpt"), default=["llama", "gpt"])
    parser.add_argument("--rounds", type=int, help="rounds over the plans (default 3; 2 with --quick)")
    parser.add_argument("--steps", type=int, help="timed steps per plan and round (default 4; 2 with --quick)")
    parser.add_argument("--warmup-rounds", type=int,
                        help="discarded rounds of one step per plan before the timed rounds (default 3; 1 with --quick)")
    parser.add_argument("--profile", type=Path, help="price with this profile instead of measuring a fresh one")
    parser.add_argument("--out", type=Path, default=OUT / "step_fidelity.json")
    parser.add_argument("--from-json", type=Path, help="re-print a saved run")
    parser.add_argument("--default-malloc", action="store_true",
                        help=f"run the profile and the steps under glibc's default malloc, not {KEPT_PAGES}")
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        for family, result in saved["families"].items():
            print_family(family, result)
        return saved
    malloc = keep_freed_pages(args.default_malloc)  # before the profile and the ranks start: they inherit it
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.steps = args.steps or (2 if args.quick else 4)
    args.warmup_rounds = (1 if args.quick else 3) if args.warmup_rounds is None else args.warmup_rounds
    from autoplan.profiler.profile import HardwareProfile

    profile_path = args.profile or args.out.with_name(args.out.stem + "_profile.json")
    if not args.profile:
        fresh_profile(profile_path, args.quick)
    profile = HardwareProfile.load(profile_path)
    saved = {"config": {"world": WORLD, "seq": SEQ, "batch": BATCH, "dtype": DTYPE, "rounds": args.rounds,
                        "warmup_rounds": args.warmup_rounds, "steps": args.steps, "quick": args.quick, "profile": str(profile_path),
                        "torch": torch.__version__, "cpus": os.cpu_count(), "malloc": malloc}, "families": {}}
    for family in args.families:
        partial = args.out.with_name(f"{args.out.stem}_{family}_partial.json")
        saved["families"][family] = run_family(family, families()[family], profile, args, partial)
        write_json(args.out, saved)
        print_family(family, saved["families"][family])
    print(draw(saved["families"], args.out.with_suffix(".png")))
    return saved


if __name__ == "__main__":
    main()
