"""The search at depth (issue 16): what makes it cheaper on deep models changes no plan (tiers 1-2).

The memory floor drops configurations before a stage problem is built; configurations whose memory
bound cannot fit are counted, not made; a stage's transient peak is read without a pass per chunk.
Each is checked against the way it replaced: the same plans, step times and ranked configurations.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from autoplan.api import capture_model, search_context, search_plans
from autoplan.cluster import ClusterSpec, parse_cluster
from autoplan.cost_model import step_sums
from autoplan.cost_model.step import StepModel
from autoplan.cost_model.step_config import Config
from autoplan.errors import InfeasibleError
from autoplan.models import get_model_config
from autoplan.models.config import ModelConfig
from autoplan.solver import search as search_module
from autoplan.solver.space import SearchOptions, enumerate_configs, fitting_configs, memory_lower_bound

MID = ModelConfig("mid-llama", "llama", 8, 1024, 16, 4, 2816, 32000, 8192, rope_theta=500000.0)


def small_gpus(nodes: int, memory_gb: float) -> ClusterSpec:
    h100 = parse_cluster(f"{nodes}x8xh100")
    return dataclasses.replace(h100, device=dataclasses.replace(h100.device, memory_bytes=memory_gb * 1e9))


def _without_provenance(plan):
    """A plan's content: the search's statistics and time in its provenance may differ."""
    return dataclasses.replace(plan, provenance=None)


@pytest.fixture(scope="module")
def gpt3_graphs():
    """GPT-3 shapes (hidden 12288, 96 heads) at 24 and 96 layers, as `benchmarks/search_scaling.py` searches them."""
    found = {}
    for layers in (24, 96):
        config = dataclasses.replace(get_model_config("gpt3-175b"), name=f"gpt3-{layers}l", num_layers=layers)
        found[layers] = (config, capture_model(config, 2048))
    return found


@pytest.mark.parametrize("layers, zero_stages", [(24, (0, 1, 2, 3)), (96, (0, 1, 2, 3)), (96, (0, 1))])
def test_the_memory_floor_changes_no_plan(gpt3_graphs, monkeypatch, layers, zero_stages):
    """With and without the floor (`StepModel.memory_floor_bytes`): the same top 3 plans, step times and ranked
    configurations; with it, fewer stage problems are built on the deep model. ZeRO 0/1 only (the FSDP
    baseline aside): a plan of the top 3 pipelines 96 layers, so the stage DP's partition is in it."""
    config, graph = gpt3_graphs[layers]
    built = []
    original = StepModel.stage_problem

    def counted(self, block, cfg):
        built.append(cfg)
        return original(self, block, cfg)

    monkeypatch.setattr(StepModel, "stage_problem", counted)

    def run():
        return search_plans(config, "16x8xh100", 128, 2048, graph=graph, info=config.rule_info(), top=3,
                            options=SearchOptions(zero_stages=zero_stages))

    with_floor, with_floor_built = run(), len(built)
    built.clear()
    monkeypatch.setattr(StepModel, "memory_floor_bytes", lambda self, block, cfg: 0.0)
    without = run()
    assert [p.config for p in with_floor.priced] == [p.config for p in without.priced]
    assert [p.step_time_s for p in with_floor.priced] == [p.step_time_s for p in without.priced]  # exactly
    assert [p.stages for p in with_floor.priced] == [p.stages for p in without.priced]
    assert list(map(_without_provenance, with_floor.plans)) == list(map(_without_provenance, without.plans))
    assert with_floor.stats.configurations == without.stats.configurations
    if layers == 96:
        assert with_floor_built < len(built) / 2 and with_floor.stats.cannot_fit > 100
    if zero_stages == (0, 1):
        assert any(p.mesh.pp > 1 for p in with_floor.plans)


def test_the_memory_floor_never_exceeds_the_priced_peak():
    """Sound for every partition: searched, given (uneven), 1F1B and interleaved, every ZeRO stage and recompute."""
    ctx = search_context(MID, small_gpus(2, 0.6), 64, 4096)
    configs = enumerate_configs(MID, ctx.cluster, 64, 4096, SearchOptions(max_microbatch_size=4, virtual_stages=(2,)))
    sample = random.Random(1).sample(configs, 60)
    sample += [c.replace(stage_layers=(1, 3, 3, 1)) for c in configs if c.pp == 2 and c.virtual_stages == 2][:5]
    assert any(c.pp > 1 and c.virtual_stages > 1 for c in sample) and any(c.pp == 1 for c in sample)
    below = 0
    for cfg in sample:
        priced = ctx.price(cfg)
        floor = ctx.steps.memory_floor_bytes(ctx.block(cfg.tp, cfg.rank_microbatch, mesh=cfg.mesh, etp=cfg.etp), cfg)
        assert 0 < floor <= priced.peak_memory_bytes * (1 + 1e-12), cfg.describe()
        below += floor > 0.5 * priced.peak_memory_bytes
    assert below > len(sample) // 2  # a floor that prunes, not a trivial one


def test_fitting_configs_are_those_whose_bound_fits_in_the_same_order():
    cluster = small_gpus(2, 2.0)
    options = SearchOptions(max_microbatch_size=4, virtual_stages=(2,), zero_stages=(0, 1, 3))
    every = enumerate_configs(MID, cluster, 64, 4096, options)
    fitting, count = fitting_configs(MID, cluster, 64, 4096, options, "bfloat16")
    expected = [c for c in every if memory_lower_bound(MID, c, 4096, "bfloat16") <= cluster.device.memory_bytes]
    assert count == len(every) and fitting == expected
    assert 0 < len(fitting) < len(every)  # the bound cuts some groups and keeps others


def test_a_stage_peak_reads_a_flat_array_once_and_others_range_by_range():
    rng = np.random.default_rng(0)
    ranges = [(0, 3), (5, 5), (7, 12)]
    for values in (np.zeros(12), np.full(12, 2.5), rng.uniform(0, 1, 12)):
        expected = max([float(values[a:b].max()) for a, b in ranges if b > a] + [0.0])
        assert step_sums.range_peak(values, ranges, step_sums.flat_value(values)) == expected
    assert step_sums.flat_value(rng.uniform(0, 1, 12)) is None and step_sums.range_peak(np.full(4, 3.0), [(2, 2)], 3.0) == 0.0


def test_an_unfit_search_still_names_the_configuration_closest_to_fitting():
    """Nothing fits the memory bound: the error still comes from every configuration's bound."""
    with pytest.raises(InfeasibleError, match="does not fit"):
        search_plans(MID, small_gpus(1, 0.01), 64, 4096, options=SearchOptions(max_microbatch_size=2))


def test_the_search_counts_configurations_it_does_not_make(monkeypatch):
    made = []
    original = Config.__init__

    def counting(self, *args, **kwargs):
        made.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(Config, "__init__", counting)
    config, cluster = get_model_config("gpt3-175b"), parse_cluster("16x8xh100")
    fitting, count = fitting_configs(config, cluster, 128, 2048, SearchOptions(), "bfloat16")
    # 96 layers of 175B: more than half cannot fit; those are counted, and only one probe per group is made
    assert len(fitting) < count / 2 and len(made) - len(fitting) < (count - len(fitting)) / 5
    assert search_module.fitting_configs is fitting_configs


@pytest.mark.parametrize("layers", [24, 96])
def test_the_step_floors_change_no_plan(gpt3_graphs, monkeypatch, layers):
    """With the time floors (`cost_model.step_bounds`: sends, data-parallel sync, slowest rank, the "full:k" a
    "full" leads to) and with none but the roofline's: the same top 3 plans, step times and ranked
    configurations (baselines on), and far fewer configurations priced with them."""
    config, graph = gpt3_graphs[layers]

    def run():
        return search_plans(config, "16x8xh100", 128, 2048, graph=graph, info=config.rule_info(), top=3)

    with_floors = run()
    monkeypatch.setattr(StepModel, "priced_above", lambda self, block, cfg, limit_s, fewer_recomputed=0: False)
    without = run()
    assert [p.config for p in with_floors.priced] == [p.config for p in without.priced]
    assert [p.step_time_s for p in with_floors.priced] == [p.step_time_s for p in without.priced]  # exactly
    assert list(map(_without_provenance, with_floors.plans)) == list(map(_without_provenance, without.plans))
    assert with_floors.stats.priced * 10 < without.stats.priced


def test_interleaved_ranks_whose_counts_decide_are_checked_without_pricing(gpt3_graphs):
    """GPT-3's first layer is often its own (its input comes from the embedding): its block has two distinct layers;
    under interleaving rank 0's first chunk holds it either way, so the contiguous fit check is exact there
    (`stage_counts.counts_decide`): a configuration it finds unable to fit is one pricing finds unable to fit,
    and one it finds able to, pricing fits (up to MEMORY_RTOL)."""
    config, graph = gpt3_graphs[96]
    ctx = search_context(config, parse_cluster("16x8xh100"), 128, 2048, graph=graph)
    configs = [c for c in enumerate_configs(config, ctx.cluster, 128, 2048, SearchOptions(orders=False))
               if c.virtual_stages > 1 and not c.recompute.startswith("full:")]
    verdicts = []
    random.Random(0).shuffle(configs)
    for cfg in configs:
        if verdicts.count(True) >= 5 and verdicts.count(False) >= 5:
            break
        block = ctx.block(cfg.tp, cfg.rank_microbatch, etp=cfg.etp)
        if len(block.distinct) == 1 or ctx.steps.memory_floor_bytes(block, cfg) > ctx.cluster.device.memory_bytes:
            continue  # one distinct layer: checked so before; over the O(1) floor: that decides first
        cannot = search_module._cannot_fit(ctx, block, cfg)
        priced = ctx.steps.price(block, cfg)
        assert cannot == (priced.peak_memory_bytes > ctx.cluster.device.memory_bytes * (1 + 1e-9)), cfg.describe()
        verdicts.append(cannot)
    assert verdicts.count(True) >= 5 and verdicts.count(False) >= 5  # both arise among them


def test_a_full_configuration_pruned_by_the_ilps_floor_is_retried_with_megatrons_layers(gpt3_graphs, monkeypatch):
    """Where "none" does not fit, "full" leads to the fewest "full:k" that fit (`_fewest_recomputed_layers`), and the
    time floor that prunes it is the ILP assignment's own: Megatron's leaner layers may fit with fewer re-run, and
    run faster. So a "full" configuration that floor prunes is retried under Megatron's assignment; it was not,
    and which plans the search found then depended on the K-th best at the moment the floor was asked."""
    config, graph = gpt3_graphs[96]
    original, pruned, retried = StepModel.priced_above, [], []

    def priced_above(self, block, cfg, limit_s, fewer_recomputed=0):
        if block.variant == "ilp" and cfg.recompute == "full" and fewer_recomputed:
            pruned.append(cfg)
            return True  # as though the K-th best were already below every ILP "full:k"
        if block.variant == "megatron-sp" and cfg in pruned:
            retried.append(cfg)
        return original(self, block, cfg, limit_s, fewer_recomputed)

    monkeypatch.setattr(StepModel, "priced_above", priced_above)
    search_plans(config, "16x8xh100", 128, 2048, graph=graph, info=config.rule_info(), top=3,
                 options=SearchOptions(zero_stages=(0, 1, 2, 3)))
    assert pruned and retried and set(retried) <= set(pruned)
