"""`--hf-model DIR` in the command line: a local Hugging Face checkpoint directory (config.json and
*.safetensors, as `save_pretrained` writes it), planned as the model `autoplan.train --hf-model DIR`
will run. Planning reads only its config.json: the model is built on meta and captured through
torch.export (`autoplan.capture.hf.capture_hf_for_planner`), its ops priced with the Hugging Face
strategy rules (`autoplan.capture.hf_rules.hf_registry`).

    search    searches the space the runtime for your own module runs (pp, dp and tp with sequence
              parallelism, ZeRO 0-3, microbatching, recompute, ep; not yet cp) and skips plans
              that runtime refuses for this model (dropout or tied weights under tp or pp):
              `autoplan.api.search_module_plans`. `--hf-config` plans the whole space instead.
    estimate  prices the configuration given, whatever it is, and says on stderr when the runtime
              for your own module cannot run it yet
    explain   per-op costs from the captured graph (`--hf-model DIR` beside the plan file)
"""

from __future__ import annotations

import sys
from pathlib import Path

from autoplan.errors import ConfigError


def add_hf_model_option(group) -> None:
    """`--hf-model DIR` in a command's group of model options."""
    group.add_argument("--hf-model", metavar="DIR",
                       help="a Hugging Face checkpoint directory (config.json + *.safetensors, as save_pretrained "
                            "writes it): planned as `autoplan.train --hf-model DIR` runs it")


def checkpoint_dir(directory: str) -> Path:
    """`directory` when it is a folder holding a config.json; ConfigError saying what to give otherwise."""
    path = Path(directory)
    if path.is_file():
        raise ConfigError(f"--hf-model {directory!r} is a file; it takes a checkpoint directory (holding "
                          f"config.json, as save_pretrained writes it); for a lone config file use --hf-config")
    if not (path / "config.json").is_file():
        found = sorted(p.name for p in path.iterdir())[:8] if path.is_dir() else None
        what = f"holds {found}" if found is not None else "does not exist"
        raise ConfigError(f"--hf-model {directory!r} {what}; expected a directory with a config.json (and "
                          f"*.safetensors weights), as transformers' save_pretrained writes it")
    return path


def capture_inputs(directory: str, seq_len: int, dtype: str) -> dict:
    """The keywords `search_plans` / `estimate` / `explain_plan` take for a captured Hugging Face
    model: its ModelConfig summary (`config`), `graph`, strategy-rule `info` and `registry`."""
    from autoplan.capture.hf import capture_hf_for_planner
    from autoplan.capture.hf_rules import hf_registry

    config, graph, info = capture_hf_for_planner(directory, seq_len, dtype)
    return {"config": config, "graph": graph, "info": info, "registry": hf_registry()}


def search_hf_model(args, cluster, profile, progress):
    """`autoplan search --hf-model DIR`: the SearchResult of the best plans the runtime for your own
    module runs (module docstring)."""
    from autoplan.api import hf_model_on_meta, search_module_plans

    model = hf_model_on_meta(checkpoint_dir(args.hf_model))
    return search_module_plans(model, cluster, args.global_batch, args.seq, top=args.top, dtype=args.dtype,
                               fold=not args.no_fold, time_limit_s=args.time_limit, progress=progress,
                               profile=profile, kernels=args.kernels, precision=args.precision)


def estimate_inputs(args) -> dict:
    """`capture_inputs` of `autoplan estimate --hf-model DIR` (or `--hf-config FILE_OR_DIR`)."""
    source = str(checkpoint_dir(args.hf_model)) if args.hf_model else args.hf_config
    return capture_inputs(source, args.seq, args.dtype)


def warn_if_not_runnable(plan, directory: str) -> None:
    """Say on stderr why `autoplan.train --hf-model` would refuse `plan` (an estimate prices any
    configuration; the runtime for your own module refuses some, `check_module_plan`)."""
    from autoplan.api import hf_model_on_meta
    from autoplan.errors import PlanError
    from autoplan.runtime.module_launch import check_module_plan

    try:
        check_module_plan(plan, hf_model_on_meta(directory), plan.cluster)
    except PlanError as exc:
        print(f"note: `autoplan.train --hf-model` cannot run this plan yet: {exc}", file=sys.stderr)


def explain_inputs(directory: str, plan) -> dict:
    """`explain_plan`'s config, graph, registry and info for a plan of the Hugging Face model in
    `directory`, captured at the plan's sequence length and dtype; ConfigError when the plan was
    made for another model."""
    captured = capture_inputs(str(checkpoint_dir(directory)), plan.seq_len, plan.dtype)
    found = captured["config"].fingerprint()
    if found != plan.model.fingerprint:
        raise ConfigError(f"--hf-model {directory!r} is another model than the plan's ({plan.model.name}: "
                          f"fingerprint {found} != {plan.model.fingerprint}); give the checkpoint the plan "
                          f"was made for, or leave --hf-model out")
    return captured
