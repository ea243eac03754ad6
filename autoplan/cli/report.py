"""Human-readable views of a Plan: what was chosen, what it costs, and where time and memory go."""

from __future__ import annotations

from collections import Counter

from rich.console import Console, Group
from rich.table import Table

from autoplan.plan import Plan

GB = 1e9


def _fmt_bytes(value: float) -> str:
    return f"{value / GB:,.2f} GB"


def _fmt_s(value: float) -> str:
    return f"{value * 1e3:,.1f} ms" if value < 1 else f"{value:,.3f} s"


def _shards_text(mesh) -> str:
    """The ranks the batch is split over: dp x ep, or dp alone with the ep ranks splitting the sequence."""
    if mesh.ep == 1:
        return f"dp {mesh.dp}"
    if mesh.ep_as == "cp":
        return f"dp {mesh.dp} (each sequence over cp x ep = {mesh.context_parallel})"
    return f"dp {mesh.dp} x ep {mesh.ep}"


def summary_table(plan: Plan) -> Table:
    """Configuration and headline predictions."""
    p = plan.predicted
    capacity = plan.cluster.device.memory_bytes
    table = Table(title=f"autoplan: {plan.model.name} on {plan.cluster.describe()}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    mesh = plan.mesh
    etp = f" etp={mesh.etp}" if mesh.etp != mesh.tp else ""  # the experts' tp (MoE parallel folding)
    ep_as = " ep_as=cp" if mesh.ep_as == "cp" else ""  # the ep ranks split the dense layers' sequences
    degrees = f"pp={mesh.pp} dp={mesh.dp} tp={mesh.tp} cp={mesh.cp} ep={mesh.ep}{etp}{ep_as}"
    table.add_row("mesh", f"{degrees}  (order {' > '.join(mesh.order)})")
    table.add_row("batch", f"global {plan.global_batch} x seq {plan.seq_len} = microbatch {plan.microbatch_size} x {plan.num_microbatches} microbatches x {_shards_text(mesh)}")
    precision = f" ({plan.precision})" if plan.dtype != "float32" else ""  # float32 casts nothing
    table.add_row("memory knobs", f"ZeRO stage {plan.zero_stage}, recompute {plan.recompute}, schedule {plan.schedule}, "
                                  f"{plan.dtype}{precision}")
    table.add_row("step time", _fmt_s(p.step_time_s))
    table.add_row("throughput", f"{p.tokens_per_s:,.0f} tokens/s")
    table.add_row("MFU", f"{p.mfu * 100:.1f}%")
    fits = "fits" if p.peak_memory_bytes <= capacity else "DOES NOT FIT"
    table.add_row("memory per GPU", f"{_fmt_bytes(p.peak_memory_bytes)} of {_fmt_bytes(capacity)} ({fits})")
    table.add_row("search", f"{plan.provenance.search_time_s:.2f} s, solver {plan.provenance.solver or '-'}")
    return table


STEP_PEAK = "peak: at the optimizer step"


def breakdown_table(plan: Plan) -> Table:
    """Step time and peak memory of the largest rank, part by part."""
    t, m = plan.predicted.time, plan.predicted.memory
    table = Table(title="where the step time and memory go (largest rank)", title_justify="left")
    for col in ("time", "", "share", "memory", " ", "share "):
        table.add_column(col, justify="right" if col.strip() in ("", "share") else "left")
    times = [("compute", t.compute_s), ("communication (exposed)", t.communication_s), ("pipeline bubble", t.bubble_s), ("optimizer", t.optimizer_s)]
    mems = [("parameters", m.parameters_bytes), ("gradients", m.gradients_bytes), ("optimizer states", m.optimizer_bytes),
            ("activations", m.activations_bytes), ("temporary buffers", m.temporary_bytes)]
    if m.ep_imbalance_bytes:  # the busiest ep rank's routed rows over the mean's (cost_model.step)
        mems.insert(4, ("ep routing imbalance margin", m.ep_imbalance_bytes))
    if m.peaks_at_optimizer_step():  # its parts are the forward + backward phase's (MemoryBreakdown)
        mems.append((STEP_PEAK, m.optimizer_step_bytes))
    total_t, total_m = max(t.total_s(), 1e-30), max(m.forward_backward_bytes(), 1e-30)
    for i in range(len(mems)):
        tname, tval = times[i] if i < len(times) else ("", None)
        mname, mval = mems[i]
        table.add_row(tname, _fmt_s(tval) if tval is not None else "", f"{tval / total_t:.0%}" if tval is not None else "",
                      mname, _fmt_bytes(mval), f"{mval / total_m:.0%}" if mname != STEP_PEAK else "")
    return table


def strategy_table(plan: Plan) -> Table:
    """How many ops took each non-replicated strategy, by op family (layer index dropped)."""
    from autoplan.cli.explain import op_family

    counts: Counter[tuple[str, str]] = Counter()
    for op in plan.ops:
        if op.strategy != "replicate":
            counts[(op_family(op.node), op.strategy)] += 1
    table = Table(title="tensor-parallel strategies chosen (ops not replicated)", title_justify="left")
    table.add_column("op")
    table.add_column("strategy")
    table.add_column("count", justify="right")
    for (family, strategy), count in sorted(counts.items()):
        table.add_row(family, strategy, str(count))
    return table


def make_console() -> Console:
    """A terminal-width console, or 120 columns when output goes to a file or pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=120)


def render_plan(plan: Plan, console: Console | None = None, details: bool = True) -> None:
    console = console or make_console()
    parts = [summary_table(plan), breakdown_table(plan)]
    if details and plan.mesh.tp > 1 and plan.ops:
        parts.append(strategy_table(plan))
    for note in plan.provenance.notes:
        parts.append(f"[yellow]note:[/yellow] {note}")
    console.print(Group(*parts))
