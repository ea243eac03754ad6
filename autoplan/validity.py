"""Which configurations can run: the one set of rules that `estimate`, the search and the runtime share.

A rule returns why a configuration cannot run (a message that names the values and what would work) or
None. `configuration_problems` applies every rule to one configuration; `estimate` raises ConfigError with
the first message, the runtime PlanError with the same message, and the search enumerates only
configurations without a problem. So what the runtime refuses, `estimate` refuses in the same words.

    tp       splits the attention heads and kv heads (only where attention is split by heads: `heads_rule`)
    cp       the context group C (cp, or cp x ep when the ep ranks split the sequence: ep_as = "cp")
             with tp divides the heads and the sequence: heads % (tp C) == 0, seq % (tp C) == 0
    ep       divides the experts and the data-parallel ranks dp x ep
    etp      divides tp; ep x tp / etp divides the experts, etp the experts' FFN width, tp x C the sequence
    batch    global_batch = microbatch x m x batch shards (dp x ep, or dp under ep_as = "cp")
    pp       pp x v chunks (v = 1 without interleaving), in the order the layers flow through them (chunk c
             of pipeline rank s at position c pp + s): each holds a contiguous range of at least one layer,
             except the first (which may hold only the embedding) and the last (only the final norm, head
             and loss), so at least pp v - 2 layers; chunk sizes need not be equal (`stages_problem` for a
             given partition). 1F1B needs m >= pp; interleaved 1F1B needs pp > 1, v >= 2 chunks per rank
             and m divisible by pp (Megatron-LM's rule, which the bubble formula assumes)
    ZeRO     0-3; ZeRO-2/3 (FSDP2) only without pp and ep (the runtime shards over dp alone)

Search heuristics (configurations that run but never pay, such as fewer than 1024 tokens per
context-parallel rank) are the search's own (`autoplan.solver.space`), not rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoplan.errors import ConfigError, PlanError
from autoplan.recompute_policy import KINDS, check_recompute

if TYPE_CHECKING:
    from autoplan.mesh import MeshShape
    from autoplan.models.config import ModelConfig

SCHEDULE_1F1B = "1f1b"
SCHEDULE_INTERLEAVED = "interleaved-1f1b"
SCHEDULE_GPIPE = "gpipe"
SCHEDULES = (SCHEDULE_1F1B, SCHEDULE_INTERLEAVED, SCHEDULE_GPIPE)
RECOMPUTE_POLICIES = tuple(KINDS)  # the kinds; "<kind>:<k>" recomputes the first k layers (recompute_policy)
ZERO_STAGES = (0, 1, 2, 3)


def nearest_multiples(value: int, step: int) -> tuple[int, ...]:
    """The multiples of `step` just below and just above `value` (positive ones only)."""
    below, above = (value // step) * step, -(-value // step) * step
    return tuple(sorted({v for v in (below, above) if v > 0} or {step}))


def _nearest_divisors(value: int, of: int, limit: int | None = None) -> list[int]:
    options = [d for d in range(1, of + 1) if of % d == 0 and (limit is None or d <= limit)]
    return sorted(options, key=lambda d: (abs(d - value), d))[:2]


def tp_problem(heads: int, kv_heads: int, tp: int) -> str | None:
    """Why `tp` cannot split the attention heads, or None."""
    if heads % tp == 0 and kv_heads % tp == 0:
        return None
    valid = [d for d in range(1, heads + 1) if heads % d == 0 and kv_heads % d == 0]
    near = sorted(valid, key=lambda d: (abs(d - tp), d))[:2]
    return (f"tp={tp} does not divide the attention heads (heads={heads}, kv_heads={kv_heads}); "
            f"nearest tp that work: {', '.join(map(str, sorted(near)))}")


def cp_problem(heads: int, tp: int, cp: int, seq_len: int, name: str = "cp") -> str | None:
    """Why context parallelism of degree `cp` (with `tp`) cannot run this sequence, or None. `name`: what
    the message calls the degree (e.g. "cp x ep" when the ep ranks split the sequence too)."""
    if cp == 1:
        return None
    if heads % (tp * cp):
        near = _nearest_divisors(cp, heads // tp if heads % tp == 0 else 1)
        return (f"{name}={cp} with tp={tp}: heads={heads} is not divisible by tp x {name} = {tp * cp}; "
                f"nearest {name} that work: {', '.join(map(str, sorted(near)))}")
    if seq_len % (tp * cp):
        largest = max(c for c in range(1, cp + 1) if seq_len % (tp * c) == 0 and heads % (tp * c) == 0)
        return (f"sequence {seq_len} is not divisible by tp x {name} = {tp * cp}: each of the {cp} context-parallel "
                f"ranks holds an equal slice; use {name} <= {largest} or a sequence divisible by {tp * cp}")
    return None


def ulysses_kv_heads(q_heads: int, kv_heads: int, cp: int) -> int:
    """The kv heads (per tp rank) that each Ulysses all-to-all of k and v carries over a context group
    of `cp`: kv_heads when cp divides them, else the smallest multiple of kv_heads that cp divides and
    that divides q_heads (Ulysses repeats kv heads of grouped-query attention). The runtimes send it
    (`runtime.context.kv_repeat`) and the step model prices it; PlanError when no multiple works."""
    for sent in range(kv_heads, q_heads + 1, kv_heads):
        if sent % cp == 0 and q_heads % sent == 0:
            return sent
    if kv_heads % cp == 0:
        return kv_heads
    raise PlanError(f"no repetition of {kv_heads} kv heads is divisible by cp={cp} and divides "
                    f"{q_heads} q heads")


def ep_problem(experts: int, ep: int, data_parallel: int) -> str | None:
    """Why `ep` cannot split the experts over the data-parallel ranks, or None."""
    if ep == 1:
        return None
    if experts == 0:
        return f"ep={ep} needs a mixture-of-experts model; this model has no experts (use ep=1)"
    if experts % ep or data_parallel % ep:
        valid = [d for d in range(1, experts + 1) if experts % d == 0 and data_parallel % d == 0]
        near = sorted(valid, key=lambda d: (abs(d - ep), d))[:2]
        return (f"ep={ep} must divide the experts ({experts}) and the data-parallel degree dp x ep ({data_parallel}); "
                f"nearest ep that work: {', '.join(map(str, sorted(near)))}")
    return None


def etp_problem(experts: int, ep: int, tp: int, etp: int, seq_len: int, cp: int = 1,
                ffn: int | None = None) -> str | None:
    """Why expert tensor-parallel degree `etp` cannot run with this model and mesh, or None. `ffn`: the
    experts' FFN width (None: not checked)."""
    if etp == tp:
        return None
    if experts == 0:
        return (f"etp={etp} with tp={tp} needs a mixture-of-experts model (etp is the tensor-parallel degree of "
                f"the experts); this model has none: leave etp unset (= tp)")
    if tp % etp:
        divisors = [d for d in range(1, tp + 1) if tp % d == 0]
        return f"etp={etp} must divide tp={tp} (the tp ranks an expert's FFN is split over); use one of {divisors}"
    if experts % (ep * tp // etp):
        return (f"etp={etp} spreads the {experts} experts over ep x tp / etp = {ep} x {tp // etp} ranks, which "
                f"does not divide them; use etp={tp}, or an ep whose ep x {tp // etp} divides {experts}")
    if seq_len % (tp * cp):
        return (f"etp={etp} splits each sequence's tokens over tp x cp = {tp * cp} ranks, which does not divide "
                f"seq_len {seq_len}; use etp={tp} or a sequence divisible by {tp * cp}")
    if ffn is not None and ffn % etp:
        return (f"etp={etp} splits each expert's FFN width {ffn} over {etp} ranks, which does not divide it; use "
                f"an etp dividing {ffn} (etp=1 keeps the experts whole)")
    return None


def batch_problem(global_batch: int, data_parallel: int, microbatch_size: int, name: str = "dp") -> str | None:
    """Why the global batch cannot be split into microbatches over the data-parallel ranks, or None. `name`:
    what the message calls their count."""
    step = data_parallel * microbatch_size
    if global_batch % step == 0:
        return None
    near = ", ".join(map(str, nearest_multiples(global_batch, step)))
    if microbatch_size == 1:
        return f"global batch {global_batch} is not divisible by {name}={data_parallel}; nearest that work: {near}"
    return (f"global batch {global_batch} is not divisible by {name}={data_parallel} x microbatch {microbatch_size} = "
            f"{step}; nearest that work: {near}")


def stage_min_layers(pp: int, virtual_stages: int) -> tuple[int, ...]:
    """The fewest layers each pipeline rank holds: v chunks of one layer, less one on the first rank (its first
    chunk may hold only the embedding) and one on the last (its last chunk only the head). Without a pipeline
    the one stage holds every layer."""
    if pp == 1:
        return (1,)
    return tuple(virtual_stages - (s == 0) - (s == pp - 1) for s in range(pp))


def pipeline_problem(num_layers: int, pp: int, schedule: str, virtual_stages: int, num_microbatches: int
                     ) -> str | None:
    """Why this pipeline schedule cannot run, or None (module docstring)."""
    chunks, fewest = pp * virtual_stages, sum(stage_min_layers(pp, virtual_stages))
    if num_layers < fewest:
        return (f"pp={pp} x v={virtual_stages} = {chunks} pipeline chunks need at least {fewest} layers (one per "
                f"chunk; the first and the last may hold only the embedding and the head) but the model has "
                f"{num_layers}; use pp x v <= {num_layers + 2}")
    if schedule == SCHEDULE_INTERLEAVED:
        if pp == 1 or virtual_stages < 2 or num_microbatches % pp:
            return (f"interleaved 1F1B needs pp > 1, v >= 2 chunks per pipeline rank and the {num_microbatches} "
                    f"microbatches divisible by pp={pp}; got pp={pp}, v={virtual_stages}")
        return None
    if schedule not in SCHEDULES or virtual_stages != 1:
        return (f"schedule {schedule!r} with v={virtual_stages}: use '{SCHEDULE_1F1B}' (v=1) or "
                f"'{SCHEDULE_INTERLEAVED}' (v >= 2)")
    if schedule == SCHEDULE_1F1B and pp > 1 and num_microbatches < pp:
        return (f"schedule '1f1b' needs num_microbatches >= pp: got {num_microbatches} < {pp}; raise the "
                f"microbatch count (a smaller microbatch) or lower pp")
    return None


def stage_layers_text(stage_layers: "tuple[int, ...]") -> str:
    """Layers per chunk as `--stage-layers` reads them, runs written N*K: (0, 1, 1, 1, 0) -> "0,1*3,0"."""
    runs: list[list[int]] = []
    for n in stage_layers:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return ",".join(f"{n}*{k}" if k > 1 else str(n) for n, k in runs)


def stages_problem(num_layers: int, pp: int, virtual_stages: int, stage_layers: "tuple[int, ...]") -> str | None:
    """Why a given partition cannot run, or None: `stage_layers` lists the layers of each of the pp x v chunks
    in the order the layers flow through them (chunk c of pipeline rank s at position c pp + s); they sum to
    the layers, and each holds at least one but the first and the last (module docstring)."""
    chunks, text = pp * virtual_stages, stage_layers_text(stage_layers)
    order = "one per pipeline rank" if virtual_stages == 1 else (
        f"chunk 0 of ranks 0..{pp - 1}, then chunk 1 of each, and so on")
    if len(stage_layers) != chunks or sum(stage_layers) != num_layers:
        return (f"stage layers {text} ({len(stage_layers)} chunks, {sum(stage_layers)} layers) must list "
                f"pp x v = {pp} x {virtual_stages} = {chunks} chunk sizes ({order}) summing to the model's "
                f"{num_layers} layers")
    short = [k for k, n in enumerate(stage_layers) if n < (0 if k in (0, chunks - 1) else 1)]
    if short:
        return (f"stage layers {text}: chunk {short[0]} holds {stage_layers[short[0]]} layers; every chunk "
                f"holds at least one layer, except the first and the last, which may hold none (only the "
                f"embedding, only the head)")
    return None


def zero_problem(zero_stage: int, pp: int, ep: int) -> str | None:
    """Why this ZeRO stage cannot run with this mesh, or None."""
    if zero_stage not in ZERO_STAGES:
        return f"zero_stage={zero_stage!r} must be one of {ZERO_STAGES}"
    if zero_stage >= 2 and (pp > 1 or ep > 1):
        return (f"zero_stage {zero_stage} (FSDP2) with ep={ep}, pp={pp}: the runtime shards parameters over dp "
                f"only without expert or pipeline parallelism; use zero_stage <= 1")
    return None


def recompute_problem(recompute: str, num_layers: int) -> str | None:
    """Why `recompute` names no policy this model can run (`autoplan.recompute_policy`), or None."""
    try:
        check_recompute(recompute, num_layers)
    except PlanError as exc:
        return str(exc)
    return None


def configuration_problems(model: "ModelConfig", mesh: "MeshShape", global_batch: int, seq_len: int,
                           microbatch_size: int, zero_stage: int, recompute: str, schedule: str,
                           virtual_stages: int, heads_rule: bool = True,
                           stage_layers: "tuple[int, ...] | None" = None) -> list[str]:
    """Every rule this configuration breaks (module docstring), in a fixed order; [] when it can run.
    `heads_rule`: tp must split the attention heads (off when a given assignment decides the strategies);
    `stage_layers`: a given partition (`stages_problem`; None: the planner's)."""
    folded = mesh.ep_as == "cp"  # the ep ranks split the sequence with cp: the rules see cp x ep
    shards = mesh.batch_shards * microbatch_size
    found = [
        tp_problem(model.heads, model.kv_heads, mesh.tp) if mesh.tp > 1 and heads_rule else None,
        cp_problem(model.heads, mesh.tp, mesh.context_parallel, seq_len, "cp x ep" if folded else "cp"),
        ep_problem(model.experts, mesh.ep, mesh.dp * mesh.ep),
        etp_problem(model.experts, mesh.ep, mesh.tp, mesh.etp, seq_len, mesh.context_parallel, model.ffn_hidden),
        batch_problem(global_batch, mesh.batch_shards, microbatch_size, "dp (ep as cp)" if folded else "dp"),
        zero_problem(zero_stage, mesh.pp, mesh.ep),
        recompute_problem(recompute, model.num_layers),
    ]
    pipeline = None if found[4] else pipeline_problem(model.num_layers, mesh.pp, schedule, virtual_stages,
                                                      global_batch // shards)
    found.append(pipeline)
    if stage_layers is not None and not pipeline:
        found.append(stages_problem(model.num_layers, mesh.pp, virtual_stages, tuple(stage_layers)))
    return [p for p in found if p]


def check(problems: "list[str] | str | None", error: type[Exception] = ConfigError) -> None:
    """Raise `error` with the first rule that failed."""
    if isinstance(problems, str):
        problems = [problems]
    if problems:
        raise error(problems[0])
