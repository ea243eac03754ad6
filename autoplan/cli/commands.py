"""The `autoplan` command line.

    autoplan search --model gpt3-175b --cluster 128x8xh100 --global-batch 1536 --seq 2048 -o plan.json
    autoplan search --model-config my_model.yaml --cluster cluster.yaml --global-batch 64 --seq 4096 --json
    autoplan search --hf-model my-llama --cluster 1x4xcpu --global-batch 8 --seq 256 --dtype float32 -o plan.json
    autoplan search ... --precision autocast            # bfloat16 under torch.autocast over fp32 weights
    autoplan search ... --top 5 --baseline megatron      # the best plans side by side, and the baselines
    autoplan estimate --model gpt3-175b --cluster 128x8xa100 --tp 8 --pp 16 --mbs 1 --global-batch 1536 --seq 2048
    autoplan show plan.json
    autoplan explain plan.json                # where the time and memory go
    autoplan compare a.json b.json            # why one plan beats the other
    autoplan models
    autoplan profile -o profile.json          # measure this machine (under torchrun: collectives too)

Bad input exits with status 2 and one line on stderr that says what was given, what was expected and what
to change (`--debug` adds the traceback); an error autoplan did not expect shows its traceback and asks for
a report (status 1).
"""

from __future__ import annotations

import argparse
import sys

from autoplan.cli.args import OneLineParser, exit_on_error, positive_float, positive_int, report_bug
from autoplan.cli import hf_model
from autoplan.validity import SCHEDULE_1F1B, SCHEDULE_INTERLEAVED
from autoplan.errors import AutoplanError
from autoplan.validate import check_output_file, path_kind


def _workload_options(p) -> None:
    """The model, the cluster and the batch: what `search` and `estimate` both take."""
    _model_options(p, hf=True)
    p.add_argument("--cluster", required=True, help="NODESxGPUSxDEVICE (e.g. 128x8xh100) or a cluster YAML/JSON file")
    p.add_argument("--global-batch", type=positive_int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq", type=positive_int, required=True, help="tokens per sequence")


def _search_parser(sub) -> None:
    p = sub.add_parser("search", help="find the fastest plan for a model on a cluster and write it")
    _workload_options(p)
    _dtype_options(p)
    p.add_argument("-o", "--output", metavar="FILE", help="write the plan JSON here")
    p.add_argument("--json", action="store_true", help="print the plan JSON to stdout instead of the tables")
    p.add_argument("--no-fold", action="store_true", help="solve the unfolded graph (slower; for comparison)")
    p.add_argument("--time-limit", type=positive_float, default=60.0, help="ILP time limit per solve, seconds")
    _profile_option(p)
    from autoplan.cli.explain import add_search_options

    add_search_options(p)


def _dtype_options(p) -> None:
    """--dtype and --precision: what `search` and `estimate` plan the weights in (`autoplan.plan.PRECISIONS`)."""
    from autoplan.plan import DTYPES, PRECISIONS

    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--precision", choices=PRECISIONS,
                   help="how a bfloat16 plan holds its weights: bf16-master (bf16 parameters, fp32 master weights, "
                   "gradients accumulated and reduced in fp32, as Megatron-LM and torchtitan train; the default for "
                   "bfloat16) or autocast (fp32 parameters and gradients, torch.autocast casting each GEMM's "
                   "weights; the only one for float16 and float32)")


def check_precision(args) -> None:
    """Refuse a --precision that cannot run --dtype before any work (`autoplan.plan.precision_problem`, the
    check `estimate`, the search and the runtime make)."""
    from autoplan.plan import precision_problem

    problem = args.precision and precision_problem(args.precision, args.dtype)
    if problem:
        raise AutoplanError(f"--precision {args.precision} with --dtype {args.dtype}: {problem}")


def _model_options(p, hf: bool = False) -> None:
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="a known model name (see `autoplan models`)")
    model.add_argument("--model-config", metavar="FILE", help="a model-config file (JSON or YAML)")
    if hf:
        model.add_argument("--hf-config", metavar="FILE_OR_DIR",
                           help="a Hugging Face config.json (or its folder): the model is built on meta and captured by torch.export")
    hf_model.add_hf_model_option(model)


def _profile_option(p) -> None:
    p.add_argument("--profile", metavar="FILE", help="hardware profile from `autoplan profile`, or a shipped one by name (h200) (GEMM efficiency, HBM "
                   "bandwidth, intra-node collectives, fused-kernel efficiencies); it must be of the cluster's device")
    p.add_argument("--kernels", default="auto", choices=("auto", "triton", "torch"),
                   help="the runtime's fused kernels, written into the plan and priced: Triton on a GPU cluster for "
                   "auto (at the profile's measured kernel efficiencies where it has them), or torch eager")


def _load_profile(args):
    from autoplan.profiler.profile import HardwareProfile

    return HardwareProfile.load(args.profile) if args.profile else None


def _recompute_arg(text: str) -> str:
    """A recompute policy name (`autoplan.recompute_policy`), refused by argparse when it is not one."""
    from autoplan.recompute_policy import recompute_policy

    try:
        recompute_policy(text)
    except AutoplanError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _estimate_parser(sub) -> None:
    p = sub.add_parser("estimate", help="price one configuration you give (how fast would my config be?)")
    _workload_options(p)
    for axis in ("tp", "pp", "cp", "ep"):
        p.add_argument(f"--{axis}", type=positive_int, default=1, help=f"{axis} degree (default 1)")
    p.add_argument("--dp", type=positive_int, help="dp degree (default: world / (tp pp cp ep))")
    p.add_argument("--etp", type=positive_int, help="the MoE experts' tensor-parallel degree, a divisor of tp: tp (default; "
                   "each expert's FFN split over tp), 1 (experts whole, the tp ranks folded into expert parallelism) "
                   "or in between (each FFN split over etp ranks, tp / etp of them folded into expert parallelism)")
    p.add_argument("--ep-as", default="dp", choices=("dp", "cp"),
                   help="what the ep ranks are to the non-expert layers: dp (default; the batch split over dp x ep) "
                   "or cp (each sequence split over cp x ep, attention's context-parallel group spanning them)")
    p.add_argument("--mbs", type=positive_int, default=1, help="microbatch size (default 1)")
    p.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3), help="ZeRO stage (default 1)")
    p.add_argument("--recompute", default="selective", type=_recompute_arg,
                   help="recompute policy: none, selective (layers keep their GEMM and attention outputs; "
                   "default), matmul-only, full, or full:<k> (the first k layers)")
    p.add_argument("--schedule", default=SCHEDULE_1F1B, choices=(SCHEDULE_1F1B, SCHEDULE_INTERLEAVED))
    p.add_argument("--virtual-stages", type=positive_int, default=1, help="model chunks per pipeline rank (interleaved)")
    p.add_argument("--stage-layers", metavar="N,N,...", type=parse_stage_layers,
                   help="layers of each pipeline chunk, pp x v of them in the order the layers flow through them: "
                   "1F1B, one per pipeline rank (e.g. 7,8,8,7 on pp 4); interleaved, chunk 0 of ranks 0..pp-1, then "
                   "chunk 1 of each, and so on. N*K repeats N K times: Llama 3 405B on pp 16, v 8 is 0,1*126,0 (the "
                   "first chunk holds only the embedding, the last only the head). Only the first and last chunk "
                   "may hold 0 layers. Default: the stage search's partition")
    _dtype_options(p)
    p.add_argument("-o", "--output", metavar="FILE", help="write the priced plan JSON here")
    p.add_argument("--json", action="store_true", help="print only the `predicted` block as JSON")
    _profile_option(p)


def parse_stage_layers(text: str) -> tuple[int, ...]:
    """"7,8*14,7" -> (7, 8, ..., 8, 7): comma-separated layer counts, N*K for K chunks of N layers."""
    sizes: list[int] = []
    for item in text.split(","):
        count, _, repeat = item.strip().partition("*")
        try:
            n, k = int(count), int(repeat) if repeat else 1
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r} is not N or N*K (whole numbers), e.g. 7,8*14,7")
        if n < 0 or k < 1:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r}: layers N >= 0 and repeats K >= 1")
        sizes += [n] * k
    return tuple(sizes)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="autoplan", description="Automatic parallelism planner for PyTorch training.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error too")
    sub = parser.add_subparsers(dest="command", required=True)
    _search_parser(sub)
    show = sub.add_parser("show", help="print a saved plan")
    show.add_argument("plan", help="a plan JSON file written by `autoplan search`")
    show.add_argument("--json", action="store_true", help="print the validated plan JSON")
    sub.add_parser("models", help="list the known model names and their shapes")
    _estimate_parser(sub)
    from autoplan.cli.explain import add_compare_parser, add_explain_parser
    from autoplan.profiler.cli import add_profile_parser

    add_explain_parser(sub)
    add_compare_parser(sub)
    add_profile_parser(sub)
    for command in sub.choices.values():  # --debug after the command too; SUPPRESS keeps a --debug given before it
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error too")
    return parser


def _load_model_config(args):
    from autoplan.models import get_model_config, load_model_config

    return load_model_config(args.model_config) if args.model_config else get_model_config(args.model)


def cmd_search(args) -> int:
    from autoplan.cluster import parse_cluster
    from autoplan.cli.explain import save_top, search_progress, search_report
    from autoplan.api import search_plans

    check_outputs(args)
    check_precision(args)
    cluster = parse_cluster(args.cluster)
    if args.hf_model:  # planned as autoplan.train --hf-model runs it: autoplan.cli.hf_model
        with search_progress() as progress:
            result = hf_model.search_hf_model(args, cluster, _load_profile(args), progress)
    else:
        captured = _hf_capture(args) if args.hf_config else {}
        config = captured.pop("config") if captured else _load_model_config(args)
        with search_progress() as progress:
            result = search_plans(config, cluster, args.global_batch, args.seq, top=args.top, dtype=args.dtype,
                                  fold=not args.no_fold, time_limit_s=args.time_limit, progress=progress,
                                  profile=_load_profile(args), kernels=args.kernels, precision=args.precision,
                                  **captured)
    plan = result.plans[0]
    if args.output:
        plan.save(args.output)
    if args.save_top:
        save_top(result, args.save_top)
    if args.json:
        print(plan.dumps())
        return 0
    from autoplan.cli.report import render_plan

    render_plan(plan)
    if args.top > 1 or args.baseline:
        print(search_report(result, args.baseline))
    if args.output:
        print(f"plan written to {args.output}")
    return 0


def _hf_capture(args) -> dict:
    """The Hugging Face model of --hf-config, captured on meta: its config summary, graph, rule info and registry."""
    from autoplan.capture.hf import capture_hf_for_planner
    from autoplan.capture.hf_rules import hf_registry

    config, graph, info = capture_hf_for_planner(args.hf_config, args.seq, args.dtype)
    return {"config": config, "graph": graph, "info": info, "registry": hf_registry()}


def cmd_estimate(args) -> int:
    import json

    from autoplan.cluster import parse_cluster
    from autoplan.mesh import MeshShape
    from autoplan.api import estimate

    check_outputs(args)
    check_precision(args)
    captured = hf_model.estimate_inputs(args) if args.hf_model or args.hf_config else {}
    config = captured.pop("config") if captured else _load_model_config(args)
    cluster = parse_cluster(args.cluster)
    others = args.tp * args.pp * args.cp * args.ep
    dp = args.dp if args.dp is not None else cluster.world_size // others
    if dp < 1 or dp * others != cluster.world_size:
        raise AutoplanError(f"tp {args.tp} x pp {args.pp} x cp {args.cp} x ep {args.ep} x dp {dp} != world size "
                            f"{cluster.world_size} of {cluster.describe()}; pick degrees whose product is {cluster.world_size}")
    mesh = MeshShape(pp=args.pp, dp=dp, tp=args.tp, cp=args.cp, ep=args.ep, etp=args.etp, ep_as=args.ep_as)
    plan = estimate(config, cluster, args.global_batch, args.seq, mesh=mesh, microbatch_size=args.mbs, zero_stage=args.zero,
                    recompute=args.recompute, dtype=args.dtype, schedule=args.schedule, virtual_stages=args.virtual_stages,
                    profile=_load_profile(args), kernels=args.kernels, stage_layers=args.stage_layers,
                    precision=args.precision, **captured)
    if args.hf_model:
        hf_model.warn_if_not_runnable(plan, args.hf_model)
    if args.output:
        plan.save(args.output)
    if args.json:
        print(json.dumps(plan.to_json()["predicted"], indent=1))
        return 0
    from autoplan.cli.report import render_plan

    render_plan(plan)
    return 0


def cmd_show(args) -> int:
    from autoplan.plan import Plan

    plan = Plan.load(args.plan)
    if args.json:
        print(plan.dumps())
    else:
        from autoplan.cli.report import render_plan

        render_plan(plan)
    return 0


def cmd_models(args) -> int:
    from rich.table import Table

    from autoplan.models import known_models
    from autoplan.cli.report import make_console

    table = Table(title="known models")
    for col in ("name", "family", "layers", "hidden", "heads", "kv heads", "ffn", "vocab", "experts", "parameters"):
        table.add_column(col, justify="left" if col in ("name", "family") else "right", no_wrap=True)
    for name, c in sorted(known_models().items()):
        experts = f"{c.experts} (top {c.top_k})" if c.experts else "-"
        table.add_row(name, c.family, str(c.num_layers), str(c.hidden), str(c.heads), str(c.kv_heads), str(c.ffn_hidden),
                      str(c.vocab), experts, f"{c.num_parameters() / 1e9:,.2f} B")
    make_console().print(table)
    return 0


def check_outputs(args) -> None:
    """Refuse an output path no file can be written to before the work that fills it, not after."""
    if getattr(args, "output", None):
        check_output_file(args.output, "-o")
    save_top = getattr(args, "save_top", None)
    if save_top and path_kind(save_top) not in ("folder", "missing"):
        raise AutoplanError(f"--save-top {save_top!r} is not a folder; expected a folder to write plan-1.json ... into")


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the command: 0 on success, 2 for bad input (one line on stderr; a usage error
    too), 1 with a traceback for an error autoplan did not expect."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help (0) or a usage error (2), already printed
        return done.code if isinstance(done.code, int) else 2
    from autoplan.cli.explain import cmd_compare, cmd_explain
    from autoplan.profiler.cli import cmd_profile

    handlers = {"search": cmd_search, "estimate": cmd_estimate, "show": cmd_show, "models": cmd_models,
                "explain": cmd_explain, "compare": cmd_compare, "profile": cmd_profile}
    try:
        return handlers[args.command](args)
    except AutoplanError as exc:
        return exit_on_error(f"autoplan {args.command}", exc, args.debug)
    except Exception as exc:  # noqa: BLE001 - anything else is a bug: shown in full, with a request to report it
        return report_bug(f"autoplan {args.command}", exc, argv)


if __name__ == "__main__":
    sys.exit(main())
