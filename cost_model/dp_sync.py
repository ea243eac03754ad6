"""The data-parallel sync of a stage, as the step model prices it (`DataParallelSync`, a part of
`cost_model.step.StepModel`).

Data-parallel sync per stage, over dp x ep x cp ranks for dense parameters and dp x cp for expert
ones (whatever etp: the ranks holding the same experts differ only in dp and cp), as the runtime runs
it (`runtime.grad_sync`): each group's gradients in n = ceil(bytes / 25 MiB) buckets
(`autoplan.grad_buckets`; `Efficiency.grad_buckets` prices another stack's size), each bucket one
collective of bytes / n, so latencies count; the bytes per
parameter are the runtime's (`memory.dp_sync_bytes`): fp32 gradients under every precision (autocast's
fp32 parameters', bf16-master's fp32 main gradients, FSDP2's reduce_dtype), weights all-gathered in the
dtype the ranks compute with (bf16 under bf16-master, fp32 otherwise);
window_b = the stage's backward of one microbatch (with recompute), window_f = its forward. A bucket
is reduced as soon as the last microbatch's backward has made it (PyTorch DDP, Megatron-Core's
overlapped gradient reduce), so the traffic hides behind that backward, except the last bucket (layer 0
and the embedding), which is ready only when the backward ends:

    hidden_behind(traffic, window) = max(last bucket's collective, traffic - window (n - 1) / n)
        (n buckets made evenly over the window, each started once made and the one before it is
        done; the last is made when backward ends)
    ZeRO 0:   all-reduce(grads) hidden behind window_b
    ZeRO 1/2: reduce-scatter(grads) hidden behind window_b, + all-gather(weights) after the optimizer
              step, exposed whole (Megatron's distributed optimizer without --overlap-param-gather;
              ZeRO 2 runs as ZeRO 1: gradients stay whole until the step, `memory.zero_as_run`)
    ZeRO 3:   m * ((all-gather against window_f) + (all-gather + reduce-scatter against window_b)), in
              FSDP2's units (one per layer, one for the ends, as `runtime.zero` makes them) instead of
              25 MiB buckets; + m * FSDP2's copies on the compute stream, which nothing hides: per
              local parameter and microbatch, each all-gather's copy-in of the shard and copy-out into
              the unsharded parameters (2 w / g + 2 w, forward and again in backward) and the
              reduce-scatter's copy of the gradients into its input and of the reduced shard out
              (2 gr + 2 gr / g); w, gr: weight and gradient bytes, g: the group's size; + m * units *
              FSDP2's fixed cost per unit beyond its calls' latencies (hooks; `Efficiency.fsdp_unit_s`,
              measured by the profile, `profiler.fsdp`), and the two all-gathers each unit waits for (before
              its forward and its backward) at `Efficiency.collective_sync_s` + the skew after the unit's
              compute (`Efficiency.skew_s`) each, however well their bytes hide: the ranks meet there out of
              step (`cost_model.comm`, "Inside a step")
    ZeRO 0-2: + the skew after the step's forward + backward, where the ranks meet at the last bucket
    ZeRO 0-2: + the buckets' copies on the compute stream (`_bucket_copies_s`): each bucket's gradients
              flattened into one buffer (read and write gr per parameter) and its sum scaled in place by
              1 / the data shards (read and write 4 B, of the 1 / g slice received under ZeRO 1/2); under
              bf16-master a bucket without replicas (one data shard) is flattened into its master's
              gradient all the same, and not scaled
    every stage: + f * (traffic - exposed), f = `Efficiency.overlap_cost`: the hidden traffic still costs the
              compute it overlaps f of its time where the collectives have no cores of their own (a CPU's
              gloo threads on the ranks' cores: `profiler.collectives.overlap_cost` measures f; 0 on a GPU)

`dp_sync_parts` names these parts (the all-reduce / reduce-scatter left after backward, the
all-gather of the parameters).

Megatron-LM of 2021, as Narayanan et al. ran it, all-reduced after the whole backward:
`Efficiency(overlap_grad_reduce=False)` prices that (no window).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from autoplan.cost_model.comm import AxisGroup
from autoplan.cost_model.compute import memory_time_s
from autoplan.cost_model.memory import FP32_BYTES, dp_sync_bytes
from autoplan.cost_model.step_config import Config
from autoplan.grad_buckets import bucket_bytes_for, bucket_count

if TYPE_CHECKING:
    from autoplan.cost_model.step import StepEnv

CORES_PART = "overlapped traffic on the compute's cores"  # `Efficiency.overlap_cost`'s part (module docstring)


class DataParallelSync:
    """The step model's data-parallel sync (module docstring): reads the model's `env` and its `group`
    (the AxisGroup an axis set of a configuration spans on the network)."""

    env: "StepEnv"
    group: Callable[[Config, tuple[str, ...]], AxisGroup]  # `StepModel.group`

    def _dp_exposed_s(self, cfg: Config, sums: dict[str, float], memo: dict[tuple, float]) -> float:
        """Data-parallel traffic of one stage not hidden behind its compute (module docstring)."""
        key = tuple(round(sums[k], 6) for k in ("dense", "expert", "buckets")) + tuple(
            round(sums[k] * 1e9) for k in ("forward", "backward"))
        if key not in memo:
            memo[key] = sum(self.dp_sync_parts(cfg, sums).values())
        return memo[key]

    def dp_sync_parts(self, cfg: Config, sums: dict[str, float]) -> dict[str, float]:
        """The exposed data-parallel sync of one stage (`_stage_sums`), by part (module docstring):
        seconds."""
        groups = self.dp_groups(cfg, sums)

        def collective(kind: str, bytes_per_param: float) -> tuple[float, float, float]:
            return self.dp_traffic(cfg, sums, groups, kind, bytes_per_param)

        def hidden_behind(traffic: tuple[float, float, float], window: float) -> float:
            """The last bucket never hides; a bucket cannot start before backward has made it: with
            n buckets made evenly over the window, the chain ends max(last, total - window (n-1)/n)
            after backward (FSDP2's units, ZeRO 3: max(last, total - window), as before)."""
            total, last, n = traffic
            usable = window if cfg.zero_stage == 3 or n == 0 else window * (n - 1) / n
            return max(last, total - usable)

        m, e = cfg.num_microbatches, self.env.efficiency
        window_b = sums["backward"] if e.overlap_grad_reduce else 0.0
        grad, weight = self.sync_bytes(cfg)
        synced = any(count and g.size > 1 for count, g in groups)
        if cfg.zero_stage == 3:
            return self._fsdp_parts(cfg, sums, groups, collective("all_gather", weight),
                                    collective("reduce_scatter", grad), hidden_behind, synced)
        reduced = collective("all_reduce" if cfg.zero_stage == 0 else "reduce_scatter", grad)
        exposed = hidden_behind(reduced, window_b)
        if cfg.zero_stage == 0:
            parts = {"gradient all-reduce after backward": exposed}
        else:
            parts = {"gradient reduce-scatter after backward": exposed,
                     "parameter all-gather after the step": collective("all_gather", weight)[0]}
        if e.overlap_cost:  # what the hidden part of the traffic takes from the backward's cores
            parts[CORES_PART] = e.overlap_cost * (reduced[0] - exposed)
        if synced and e.collective_skew:  # the ranks meet at the last bucket out of step by the whole forward + backward
            parts["ranks out of step at the sync"] = e.skew_s(m * (sums["forward"] + sums["backward"]))
        copies = self._bucket_copies_s(cfg, groups)
        if copies:
            parts["gradient bucket copies (flatten, scale)"] = copies
        return parts

    def _bucket_copies_s(self, cfg: Config, groups) -> float:
        """Seconds of the runtime's copies around ZeRO 0-2's buckets (module docstring; `runtime.grad_sync`)."""
        gr = self.sync_bytes(cfg)[0]
        masters = cfg.precision == "bf16-master"
        nbytes = 0.0
        for count, g in groups:
            if count and g.size > 1:
                nbytes += count * (2 * gr + 2 * FP32_BYTES / (g.size if cfg.zero_stage else 1))
            elif count and masters:
                nbytes += count * 2 * gr
        return memory_time_s(nbytes, self.env.cluster.device, self.env.efficiency) if nbytes else 0.0

    def _fsdp_parts(self, cfg: Config, sums: dict[str, float], groups, ag, rs, hidden_behind, synced: bool
                    ) -> dict[str, float]:
        """ZeRO 3's exposed sync by part (`dp_sync_parts`): FSDP2's units, per microbatch."""
        e, m = self.env.efficiency, cfg.num_microbatches
        window_b, window_f = (sums["backward"], sums["forward"]) if e.overlap_grad_reduce else (0.0, 0.0)
        backward = (ag[0] + rs[0], ag[1] + rs[1], ag[2])
        exposed_f, exposed_b = hidden_behind(ag, window_f), hidden_behind(backward, window_b)
        parts = {"parameter all-gathers (FSDP2)": m * exposed_f,
                 "backward all-gathers and reduce-scatters (FSDP2)": m * exposed_b,
                 "all-gather and reduce-scatter copies (FSDP2)": m * self._fsdp_copies_s(cfg, groups),
                 "fixed cost per unit (FSDP2)": m * ag[2] * (e.fsdp_unit_s + 2 * e.collective_sync_s)}
        if e.overlap_cost:  # what the hidden part of the traffic takes from the compute's cores
            parts[CORES_PART] = e.overlap_cost * m * (ag[0] - exposed_f + backward[0] - exposed_b)
        if synced and e.collective_skew:  # each unit's all-gathers wait out the skew of the unit's compute
            units = max(1.0, ag[2])
            parts["ranks out of step at each unit (FSDP2)"] = m * ag[2] * (
                e.skew_s(sums["forward"] / units) + e.skew_s(sums["backward"] / units))
        return parts

    def sync_bytes(self, cfg: Config) -> tuple[float, float]:
        """(gradient, weight) bytes per parameter the data-parallel sync of `cfg` moves (`memory.dp_sync_bytes`:
        fp32 gradients under every precision, weights as the ranks compute with them)."""
        return dp_sync_bytes(self.env.dtype, cfg.precision, cfg.zero_stage)

    def dp_groups(self, cfg: Config, sums: dict[str, float]) -> tuple[tuple[float, AxisGroup], ...]:
        """(parameters, group) of the dense and the expert parameters' data-parallel sync."""
        return (sums["dense"], self.group(cfg, ("dp", "ep", "cp"))), (sums["expert"], self.group(cfg, ("dp", "cp")))

    def dp_traffic(self, cfg: Config, sums: dict[str, float], groups, kind: str,
                   bytes_per_param: float) -> tuple[float, float, float]:
        """(all buckets' seconds, the largest bucket's, the most buckets of a group) of `kind` over `groups`
        (`dp_groups`): each group's parameters in n buckets of 1 / n each (FSDP2's units under ZeRO 3: one per
        layer and one for the ends; else `autoplan.grad_buckets` under the efficiency's rule)."""
        total = last = most = 0.0
        grad, rule = self.sync_bytes(cfg)[0], self.env.efficiency.grad_buckets
        for count, g in groups:
            if count and g.size > 1:
                n = sums["buckets"] if cfg.zero_stage == 3 else bucket_count(count * grad, bucket_bytes_for(rule, g.size, grad))
                each = self.env.efficiency.collective_s(kind, bytes_per_param * count / n, self.env.cluster, g)
                total, last, most = total + n * each, max(last, each), max(most, n)
        return total, last, most

    def _fsdp_copies_s(self, cfg: Config, groups) -> float:
        """Seconds of FSDP2's copies around one microbatch's collectives (module docstring, ZeRO 3)."""
        gr, w = self.sync_bytes(cfg)
        nbytes = sum(count * (2 * (2 * w / g.size + 2 * w) + 2 * gr + 2 * gr / g.size)
                     for count, g in groups if count and g.size > 1)
        return memory_time_s(nbytes, self.env.cluster.device, self.env.efficiency)
