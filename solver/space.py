"""The outer search space and the bounds that prune it before anything is costed.

A configuration (`Config`) fixes the mesh pp x dp x ep x cp x tp, the microbatch size and count, the
ZeRO stage, the recompute policy and the pipeline schedule. Enumerated (`enumerate_configs`):

    tp   divides the GPUs per node (tensor parallelism stays inside a node) and the world size, and splits
         the attention heads and kv heads (`validity.tp_problem`, the rule `estimate` applies), so that
         the search returns no plan that `estimate` of its mesh refuses
    cp   1, 2, 4, ... while the sequence rules hold (`validity.cp_problem`)
    pp   divides world / (tp cp), at most the number of layers
    D    = world / (tp cp pp), the data-parallel degree, must divide the global batch
    ep   divides D and the experts (MoE models only); the mesh's dp axis is D / ep
    ep_as what the ep ranks are to the non-expert layers (`MeshShape.ep_as`): "dp" (the batch split over
         dp x ep: D must divide the global batch), and "cp" for MoE models with ep > 1 where the sequence
         rules hold for cp x ep (`validity.cp_problem`; cp may be 1): each sequence split over cp x ep,
         the batch over dp alone (dp must divide it); not at microbatches where ep_as = "dp" does the same
         work per rank with less communication (`_dominated_by_ep_as_dp`)
    etp  the experts' tensor-parallel degree (`MeshShape.etp`): tp, and for MoE models with tp > 1 every
         smaller divisor of tp where ep x tp / etp divides the experts, etp the experts' FFN width and
         tp x cp the sequence (`validity.etp_problem`)
    mbs  divides global_batch / B, at most `max_microbatch_size`; m = global_batch / (B mbs), with B the batch
         shards: D, or dp under ep_as = "cp"
    schedule 1F1B, or interleaved 1F1B with v virtual stages when pp > 1, the layers divide by pp v
         and m divides by pp
    ZeRO 0-3, recompute none / selective / matmul-only / full on every layer (`autoplan.recompute_policy`),
         and "full:k" (the first k layers) searched by the branch and bound where it pays
    order of the axes over ranks: the default (tp innermost), and cp, ep or dp innermost where that changes
         which priced groups stay inside a node (`mesh_orders`); it changes only links, never FLOPs or memory

Bounds, both sound (never above the priced value), so pruning by them never loses the optimum:

    memory  >= [states(N_dense / (tp pp), D cp) + states(N_expert / (tp pp ep), D cp / ep)
                                                     (dp x ep x cp hold the same dense shards whatever ep_as)
                                                     (experts split over ep x tp either way: etp x tp / etp)
                + L * a_min / pp]                    states() as ZeRO divides them (cost_model.memory);
               a_min = (mbs / C) * T * hidden * itemsize / tp, the smallest thing a layer keeps (its
               input, sequence-sharded); every stage keeps >= 1 microbatch, the largest stage >= the mean
    time    >= (m + (pp - 1) / v) * S / pp          S: one microbatch's compute per rank at the roofline's
               compute rate, (mbs / C) * (forward + backward + recomputed FLOPs per sequence) / tp /
               (peak * matmul efficiency): every op takes at least its FLOPs at that rate
               (compute.op_time_s) and a tp shard does at least 1 / tp of them; the pipeline formula
               with its slowest stage >= the mean (cost_model.pipeline); C = cp, or cp x ep under ep_as = "cp"
               (`Config.context_parallel`)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autoplan.cluster import ClusterSpec
from autoplan.cost_model.memory import model_state_bytes, state_bytes_for
from autoplan.cost_model.parallel_dims import axes_group
from autoplan.validity import (SCHEDULE_1F1B, SCHEDULE_INTERLEAVED, cp_problem, etp_problem, nearest_multiples,
                               pipeline_problem, tp_problem, zero_problem)
from autoplan.cost_model.step_config import ITEMSIZE, Config
from autoplan.errors import ConfigError, InfeasibleError, PlanError
from autoplan.mesh import DEFAULT_ORDER, MeshShape
from autoplan.models.config import ModelConfig
from autoplan.validity import ZERO_STAGES
from autoplan.validate import check_int
from autoplan.recompute_policy import SEARCHED, recompute_policy

MIN_TOKENS_PER_CP_RANK = 1024  # a search heuristic, not a rule: `_worth_cp`


@dataclass(frozen=True)
class SearchOptions:
    """Which parts of the space to search."""

    max_microbatch_size: int = 16
    pipeline: bool = True
    context_parallel: bool = True
    expert_parallel: bool = True
    expert_tensor_parallel: bool = True  # also try every etp < tp dividing it (tp / etp folded into the ep group)
    ep_over_cp: bool = True  # also try ep_as = "cp" (the ep ranks as context-parallel ranks of the dense layers)
    virtual_stages: tuple[int, ...] = (2, 3, 4, 6, 8)
    zero_stages: tuple[int, ...] = ZERO_STAGES
    recompute: tuple[str, ...] = SEARCHED  # policy names (`autoplan.recompute_policy`), each on every layer
    partial_recompute: bool = True  # where "full" fits and "none" does not: the fewest layers "full:k" needs
    orders: bool = True  # also try the other orders of the axes over ranks (`mesh_orders`)
    precision: str = "autocast"  # of every configuration (`autoplan.plan.PRECISIONS`; the search sets its dtype's)

    def __post_init__(self) -> None:
        check_int("SearchOptions max_microbatch_size", self.max_microbatch_size)
        for name in ("pipeline", "context_parallel", "expert_parallel", "expert_tensor_parallel", "ep_over_cp", "orders"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"SearchOptions {name}={getattr(self, name)!r}: expected True or False")
        for v in _tuple("virtual_stages", self.virtual_stages):
            check_int("SearchOptions virtual_stages entry", v, minimum=2)
        zero = _tuple("zero_stages", self.zero_stages)
        if not all(type(z) is int for z in zero) or not set(zero) <= set(ZERO_STAGES):
            raise ConfigError(f"zero_stages {self.zero_stages} must be within {ZERO_STAGES}")
        for name in _tuple("recompute", self.recompute):
            try:
                recompute_policy(name)
            except PlanError as exc:
                raise ConfigError(f"SearchOptions.recompute: {exc}") from None


def _tuple(name: str, value: object) -> tuple:
    if not isinstance(value, tuple):
        raise ConfigError(f"SearchOptions {name}={value!r}: expected a tuple")
    return value


# Orders of the axes over ranks tried besides the default (tp innermost): cp or ep innermost keeps a
# heavy Ulysses or expert all-to-all group inside a node; dp innermost keeps the gradient group there.
ORDERS: tuple[tuple[str, ...], ...] = (
    DEFAULT_ORDER,
    ("pp", "dp", "ep", "tp", "cp"),
    ("pp", "dp", "cp", "tp", "ep"),
    ("pp", "ep", "cp", "tp", "dp"),
)
# the groups the step model prices, whose links (NVLink or network, ranks per node) an order decides
PRICED_GROUPS: tuple[tuple[str, ...], ...] = (("tp",), ("cp",), ("ep",), ("pp",), ("dp", "ep", "cp"), ("dp", "cp"))


def mesh_orders(tp: int, cp: int, pp: int, ep: int, dp: int, gpus_per_node: int,
                etp: int | None = None, ep_as: str = "dp") -> tuple[tuple[str, ...], ...]:
    """The orders of `ORDERS` that give this mesh different links, the first of each kind (the default first).

    Two orders are equivalent for a mesh when every priced group (`PRICED_GROUPS`, the experts' ep x tp group
    under etp < tp, and the Ulysses ep x cp group under ep_as = "cp") spans the same nodes with the same ranks per
    node under both (e.g. moving an axis of degree 1, or several axes that stay inside one node either way)."""
    found: dict[tuple, tuple[str, ...]] = {}
    for order in ORDERS:
        mesh = MeshShape(pp=pp, dp=dp, tp=tp, cp=cp, ep=ep, order=order, etp=etp, ep_as=ep_as)
        groups = (PRICED_GROUPS + ((mesh.expert_axes, mesh.expert_tp_axes) if mesh.etp < tp else ())
                  + ((mesh.context_axes,) if mesh.ep_as == "cp" else ()))
        found.setdefault(tuple(axes_group(mesh, axes, gpus_per_node) for axes in groups), order)
    return tuple(found.values())


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending, found in O(sqrt n) steps."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def divisors_up_to(n: int, limit: int) -> list[int]:
    """The divisors of n >= 1 that are at most `limit`, ascending (n may be huge, the limit is small)."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def tp_degrees(model: ModelConfig, cluster: ClusterSpec) -> list[int]:
    """The tp searched (module docstring): divisors of the GPUs per node that divide the world size and split
    the attention heads and kv heads as `estimate` demands (`validity.tp_problem`)."""
    return [t for t in divisors(cluster.gpus_per_node)
            if cluster.world_size % t == 0 and tp_problem(model.heads, model.kv_heads, t) is None]


def _cp_degrees(model: ModelConfig, tp: int, seq_len: int, room: int, options: SearchOptions) -> list[int]:
    found, cp = [1], 2
    while options.context_parallel and cp <= room:
        if room % cp == 0 and _worth_cp(model, tp, cp, seq_len):
            found.append(cp)
        cp *= 2
    return found


def _worth_cp(model: ModelConfig, tp: int, cp: int, seq_len: int) -> bool:
    """Whether a context group of `cp` ranks can run (`validity.cp_problem`) and pays: with fewer than
    MIN_TOKENS_PER_CP_RANK tokens per rank the all-to-all latencies and flash-attention tiles underfill."""
    return cp_problem(model.heads, tp, cp, seq_len) is None and seq_len // cp >= MIN_TOKENS_PER_CP_RANK


def enumerate_meshes(model: ModelConfig, cluster: ClusterSpec, global_batch: int, seq_len: int,
                     options: SearchOptions) -> list[tuple[int, int, int, int, int, str]]:
    """(tp, cp, pp, ep, dp axis, ep_as) of every mesh the module docstring allows."""
    world, found = cluster.world_size, []
    for tp in tp_degrees(model, cluster):
        for cp in _cp_degrees(model, tp, seq_len, world // tp, options):
            for pp in divisors(world // (tp * cp)):
                if pp > model.num_layers or (pp > 1 and not options.pipeline):
                    continue
                data = world // (tp * cp * pp)
                for ep in divisors(data):
                    if ep == 1 or (options.expert_parallel and model.experts and model.experts % ep == 0):
                        found.extend((tp, cp, pp, ep, data // ep, ep_as)
                                     for ep_as in _ep_roles(model, global_batch, seq_len, (tp, cp, ep, data), options))
    if not found:
        raise ConfigError(_no_mesh_message(model, cluster, global_batch, options))
    return found


def _ep_roles(model: ModelConfig, global_batch: int, seq_len: int, degrees: tuple[int, int, int, int],
              options: SearchOptions) -> tuple[str, ...]:
    """What the ep ranks may be to the non-expert layers for (tp, cp, ep, D): "dp" where D divides the batch,
    "cp" (ep > 1 only) where dp = D / ep divides it and cp x ep obeys the sequence rules."""
    tp, cp, ep, data = degrees
    roles = ("dp",) if global_batch % data == 0 else ()
    if (ep > 1 and options.ep_over_cp and global_batch % (data // ep) == 0
            and _worth_cp(model, tp, cp * ep, seq_len)):
        roles += ("cp",)
    return roles


def _no_mesh_message(model: ModelConfig, cluster: ClusterSpec, global_batch: int, options: SearchOptions) -> str:
    world = cluster.world_size
    largest = max(t * p for t in tp_degrees(model, cluster)
                  for p in divisors(world // t) if p <= model.num_layers and (p == 1 or options.pipeline))
    smallest_dp = world // largest
    near = ", ".join(map(str, nearest_multiples(global_batch, smallest_dp)))
    return (f"global batch {global_batch} is not divisible by dp={smallest_dp}, the smallest data-parallel degree "
            f"world / (tp x pp) allows on {cluster.describe()} (tp dividing {cluster.gpus_per_node} GPUs per node "
            f"and the heads, pp <= {model.num_layers} layers); nearest that work: {near}")


def expert_tp_degrees(model: ModelConfig, tp: int, cp: int, ep: int, seq_len: int,
                      options: SearchOptions) -> tuple[int | None, ...]:
    """The etp searched for a mesh: None (= tp) always, then every smaller divisor of tp, ascending, that
    runs (`validity.etp_problem`). `cp`: how many ways the dense layers split the sequence (x ep under
    ep_as = "cp")."""
    if not options.expert_tensor_parallel or tp == 1 or not model.experts:
        return (None,)
    return (None,) + tuple(etp for etp in divisors(tp)[:-1]
                           if etp_problem(model.experts, ep, tp, etp, seq_len, cp, model.ffn_hidden) is None)


def runnable_zero_stages(stages: tuple[int, ...], pp: int, ep: int) -> tuple[int, ...]:
    """ZeRO stages searched for a mesh: with pipeline or expert parallelism only 0 and 1.

    ZeRO-2/3 reduce-scatter gradients (and gather weights) per microbatch; under a pipeline schedule
    that traffic repeats for every microbatch of every stage, which is why DeepSpeed refuses ZeRO-2/3
    with pipeline parallelism, and this runtime shards with FSDP2 over dp only without pp or ep
    (`autoplan.runtime.launch` refuses it). `autoplan estimate` still prices such a configuration."""
    return tuple(z for z in stages if zero_problem(z, pp, ep) is None)


def enumerate_configs(model: ModelConfig, cluster: ClusterSpec, global_batch: int, seq_len: int,
                      options: SearchOptions) -> list[Config]:
    """Every configuration of the module docstring, in a fixed order."""
    return _enumerate(model, cluster, global_batch, seq_len, options, None)[0]


def fitting_configs(model: ModelConfig, cluster: ClusterSpec, global_batch: int, seq_len: int, options: SearchOptions,
                    dtype: str) -> tuple[list[Config], int]:
    """The configurations of `enumerate_configs` whose memory lower bound fits the device, in its order, and how many
    it has in all. The bound reads only the mesh's degrees, the microbatch and the ZeRO stage, so it is found once
    per (mesh, microbatch, ZeRO stage), and the configurations of a group that cannot fit are counted, never made:
    on a deep model most of them (96 GPT-3 layers on 16 x 8 H100: 5188 of 9144)."""
    sizes, limit = parameter_split(model), cluster.device.memory_bytes
    return _enumerate(model, cluster, global_batch, seq_len, options,
                      lambda cfg: memory_lower_bound(model, cfg, seq_len, dtype, sizes) <= limit)


def _enumerate(model: ModelConfig, cluster: ClusterSpec, global_batch: int, seq_len: int, options: SearchOptions,
               keep) -> tuple[list[Config], int]:
    """The configurations in their fixed order, those of a (mesh, microbatch, ZeRO stage) left out where `keep` (None:
    keep all) refuses its first; and how many there are, left out or not."""
    configs, total = [], 0
    for tp, cp, pp, ep, dp, ep_as in enumerate_meshes(model, cluster, global_batch, seq_len, options):
        context = cp * ep if ep_as == "cp" else cp
        for etp in expert_tp_degrees(model, tp, context, ep, seq_len, options):
            orders = (mesh_orders(tp, cp, pp, ep, dp, cluster.gpus_per_node, etp, ep_as) if options.orders
                      else (DEFAULT_ORDER,))
            made, count = _mesh_configs(model, global_batch, options, (tp, cp, pp, ep, dp), etp, orders, ep_as, keep)
            configs.extend(made)
            total += count
    return configs, total


def _mesh_configs(model: ModelConfig, global_batch: int, options: SearchOptions, degrees: tuple[int, ...],
                  etp: int | None, orders: tuple[tuple[str, ...], ...], ep_as: str, keep) -> tuple[list[Config], int]:
    """The configurations of one mesh (tp, cp, pp, ep, dp), etp and ep_as: microbatches, schedules, ZeRO,
    recompute (`_enumerate`: those `keep` refuses counted, not made), and how many there are."""
    tp, cp, pp, ep, dp = degrees
    per_rank, configs, total = global_batch // (dp if ep_as == "cp" else dp * ep), [], 0
    meshes = [MeshShape(pp=pp, dp=dp, tp=tp, cp=cp, ep=ep, order=order, etp=etp, ep_as=ep_as) for order in orders]
    for mbs in (d for d in divisors_up_to(per_rank, options.max_microbatch_size)
                if not _dominated_by_ep_as_dp(global_batch, dp, ep, d, ep_as)):
        m = per_rank // mbs
        schedules = [(s, v) for s, v in [(SCHEDULE_1F1B, 1)] + [(SCHEDULE_INTERLEAVED, v) for v in options.virtual_stages]
                     if pipeline_problem(model.num_layers, pp, s, v, m) is None]
        zeros = runnable_zero_stages(options.zero_stages, pp, ep)
        precision = options.precision
        kept = [z for z in zeros if keep is None or keep(Config(meshes[0], mbs, m, z, "none", precision=precision))]
        total += len(schedules) * len(zeros) * len(options.recompute) * len(meshes)
        for schedule, v in schedules:
            for zero in kept:
                for recompute in options.recompute:
                    configs.extend(Config(mesh, mbs, m, zero, recompute, schedule, v, precision=precision)
                                   for mesh in meshes)
    return configs, total


def _dominated_by_ep_as_dp(global_batch: int, dp: int, ep: int, mbs: int, ep_as: str) -> bool:
    """Whether ep_as = "cp" at microbatch `mbs` is never faster than ep_as = "dp" at mbs / ep on the same mesh, which
    is then enumerated too: each rank holds the same tokens (mbs / (cp ep) sequences), FLOPs, activations,
    parameters, expert all-to-alls and data-parallel sync, and m is the same; only the Ulysses group grows by ep
    (more communication, never less). So ep_as = "cp" is searched only where it is new: below a sequence per ep
    rank (mbs not a multiple of ep), or where the batch does not split over dp x ep."""
    return ep_as == "cp" and mbs % ep == 0 and global_batch % (dp * ep) == 0


# ---------------------------------------------------------------------------------- bounds


def expert_parameters(model: ModelConfig) -> int:
    """Parameters of the routed experts' FFNs (3 E r f per MoE layer, r = hidden or BigMac's low width),
    which ep divides; dense first layers and shared experts are not among them."""
    return model.expert_parameters() if model.experts else 0


def memory_lower_bound(model: ModelConfig, cfg: Config, seq_len: int, dtype: str,
                       sizes: tuple[int, int] | None = None) -> float:
    """A bound no priced configuration goes below (module docstring), in bytes per rank. `sizes`:
    (dense, expert) parameter counts, when the caller has them (the count walks the config)."""
    state = state_bytes_for(dtype, cfg.precision)
    experts = expert_parameters(model) if sizes is None else sizes[1]
    dense = model.num_parameters() - experts if sizes is None else sizes[0]
    data = cfg.data_ranks
    states = sum(model_state_bytes(dense / (cfg.tp * cfg.pp), data, cfg.zero_stage, state))
    if experts:
        states += sum(model_state_bytes(experts / (cfg.tp * cfg.pp * cfg.ep), data // cfg.ep, cfg.zero_stage, state))
    # mbs / C as a float (= float(cfg.rank_microbatch), both correctly rounded) without making the Fraction
    a_min = cfg.microbatch_size / cfg.context_parallel * seq_len * model.hidden * ITEMSIZE[dtype] / cfg.tp
    return states + model.num_layers * a_min / cfg.pp


def parameter_split(model: ModelConfig) -> tuple[int, int]:
    """(dense, expert) parameter counts."""
    experts = expert_parameters(model)
    return model.num_parameters() - experts, experts


@dataclass(frozen=True)
class FlopsPerSequence:
    """Per sequence of the captured graph: forward, backward, the layers' forward (what full recompute
    re-runs) and, per op family, the layers' forward of its ops (what a policy saving it does not)."""

    forward: float
    backward: float
    layers: float
    saved: tuple[tuple[str, float], ...] = ()
    num_layers: int = 1
    _by_policy: dict = field(default_factory=dict, compare=False, repr=False)  # per_microbatch's, per policy name

    def per_microbatch(self, recompute: str) -> float:
        if recompute not in self._by_policy:  # asked once per configuration that passes the memory bound
            policy = recompute_policy(recompute)
            share = len(policy.recomputed_layers(self.num_layers)) / max(self.num_layers, 1)
            kept = sum(flops for family, flops in self.saved if policy.saves_family(family))
            self._by_policy[recompute] = self.forward + self.backward + share * (self.layers - kept)
        return self._by_policy[recompute]


def time_lower_bound_s(cfg: Config, flops: FlopsPerSequence, flops_per_s: float) -> float:
    """The pipeline formula at the mean stage, compute at `flops_per_s` (module docstring)."""
    per_microbatch_s = float(cfg.rank_microbatch) * flops.per_microbatch(cfg.recompute) / cfg.tp / flops_per_s
    return (cfg.num_microbatches + (cfg.pp - 1) / cfg.virtual_stages) * per_microbatch_s / cfg.pp


def nearest_gpus(model: ModelConfig, cluster: ClusterSpec, seq_len: int, dtype: str) -> int | None:
    """About how many of the cluster's devices could hold the model at `seq_len`, or None when no number can.

    A lower bound in the spirit of `memory_lower_bound`, on G devices with 10% of each left for buffers
    (budget B = 0.9 x capacity): the model states S = N x (weight + grad + optimizer bytes) sharded over all
    G ranks (ZeRO-3), and the activations of one sequence, X = L x T x hidden x itemsize (every layer keeps at
    least its input), split at most tp x cp x pp ways, where tp x cp <= heads (each rank keeps whole heads)
    and pp <= L. So a rank holds >= S / G + X / min(G, heads x L), and G is the smallest with that <= B."""
    state = state_bytes_for(dtype)
    states = (state.weight + state.grad + state.optimizer) * model.num_parameters()
    activations = model.num_layers * seq_len * model.hidden * ITEMSIZE[dtype]
    budget, widest = 0.9 * cluster.device.memory_bytes, model.heads * model.num_layers
    gpus = math.ceil((states + activations) / budget)
    if gpus > widest:  # past heads x L ranks the activations split no further
        left = budget - activations / widest
        if left <= 0:
            return None
        gpus = max(widest + 1, math.ceil(states / left))
    return max(cluster.world_size + 1, gpus)


def too_small_message(model: ModelConfig, cluster: ClusterSpec, seq_len: int, dtype: str, smallest: float,
                      smallest_cfg: Config | None, bound: bool) -> str:
    """The cluster cannot hold the model: by how much, and about how many GPUs would (`nearest_gpus`)."""
    state = state_bytes_for(dtype)
    per_param = state.weight + state.grad + state.optimizer
    have = cluster.device.memory_bytes
    where = f" ({smallest_cfg.describe()})" if smallest_cfg else ""
    gpus = nearest_gpus(model, cluster, seq_len, dtype)
    if gpus is None:
        keep = model.num_layers * seq_len * model.hidden * ITEMSIZE[dtype] / (model.heads * model.num_layers)
        helps = (f"a shorter sequence than {seq_len}: no number of {cluster.device.name} GPUs could work, since one "
                 f"sequence's activations split over every head and layer still need {keep / 1e9:.1f} GB per GPU")
    else:
        nodes = -(-gpus // cluster.gpus_per_node)
        helps = (f"more GPUs (the nearest cluster that could work has about {gpus} GPUs: {nodes} nodes of "
                 f"{cluster.gpus_per_node}), or a shorter sequence than {seq_len}")
    return (f"{model.name} ({model.num_parameters() / 1e9:.1f} B parameters, {per_param:.0f} bytes each with Adam) "
            f"does not fit {cluster.describe()}: the smallest configuration needs {'at least ' if bound else ''}"
            f"{smallest / 1e9:.1f} GB per GPU{where} but each {cluster.device.name} has {have / 1e9:.1f} GB "
            f"({(smallest - have) / 1e9:.1f} GB over). What would help: {helps}")


def infeasible(model: ModelConfig, cluster: ClusterSpec, seq_len: int, dtype: str, smallest: float,
               smallest_cfg: Config | None, bound: bool = True) -> InfeasibleError:
    return InfeasibleError(too_small_message(model, cluster, seq_len, dtype, smallest, smallest_cfg, bound))
