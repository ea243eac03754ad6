"""`autoplan.train --hf-model DIR`: fine-tune a local Hugging Face checkpoint under a plan.

    torchrun --nproc-per-node 4 -m autoplan.train --hf-model my-llama --steps 40 --save-hf my-llama-tuned
    torchrun --nproc-per-node 4 -m autoplan.train --hf-model my-llama --plan plan.json --data text.txt

DIR is a directory as `save_pretrained` writes it (config.json and *.safetensors). Every rank builds
the model on meta from config.json; without --plan, rank 0 plans it for the launched world (a
`1xNxcpu` cluster, or `--cluster`) over what the runtime for your own module runs and broadcasts
the plan (`autoplan.api.search_module_plans`); each rank then reads only its slices of the weights
(`autoplan.runtime.weights`). It trains on the data of the zoo path (`autoplan.train`: a text file's
bytes modulo the vocabulary, or the seeded synthetic tokens), targets = the next tokens: per window
of T tokens, the mean cross-entropy of the T predictions against the stream shifted by one, which is
transformers' shifted next-token loss (`model(input_ids, labels=input_ids)`) with the window's
next token as the last label, where transformers has none.

At the end, the loss of the trained weights on the batch after the last one (`eval_loss`, also in
--log-json) is printed, and with `--save-hf OUT` the weights are written as a Hugging Face checkpoint
that `transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads (`autoplan.runtime.hf_export`;
OUT must be new, empty or an earlier export of autoplan: checked before training starts).

--save DIR / --save-every N / --keep K / --resume DIR / --auto-resume save and resume DCP checkpoints
of the parameters (under the model's own names), the optimizer state and the step, as for the zoo
models (`autoplan.runtime.checkpoint`, `autoplan.runtime.module_checkpoint`): the same files, checks
and atomic saves; a run resumes under any plan of the same model (another --plan, or world size).
Plans with cp (and what else the runtime for your own module does not run yet) are refused by the
runtime with what to change.
"""

from __future__ import annotations

import os
from pathlib import Path

from autoplan.errors import ConfigError


def add_hf_options(parser, model_group) -> None:
    """--hf-model (beside --model in `model_group`) and --save-hf."""
    model_group.add_argument("--hf-model", metavar="DIR",
                             help="a Hugging Face checkpoint directory (config.json + *.safetensors) to fine-tune")
    parser.add_argument("--save-hf", metavar="OUT",
                        help="with --hf-model: write the trained weights as a Hugging Face checkpoint here")


def check_hf_args(args) -> None:
    """Refuse --save-hf without --hf-model or onto a directory autoplan may not write, and an
    --hf-model DIR that is no checkpoint, before anything is built (module docstring)."""
    if not args.hf_model:
        if args.save_hf:
            raise ConfigError(f"--save-hf {args.save_hf}: exports a Hugging Face model trained with "
                              f"--hf-model DIR; a zoo model (--model) saves with --save DIR (DCP)")
        return
    if args.save_hf:
        from autoplan.runtime.hf_export import export_target_error

        error = export_target_error(Path(args.save_hf))
        if error:
            raise ConfigError(f"--save-hf: {error}")
    checkpoint_files(args.hf_model)


def checkpoint_files(directory: str) -> Path:
    """`directory` when it holds config.json and *.safetensors; ConfigError naming what is missing."""
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"--hf-model {directory!r} is not a directory; give a checkpoint directory as "
                          f"save_pretrained writes it (config.json + *.safetensors)")
    missing = [what for what, pattern in (("config.json", "config.json"), ("*.safetensors", "*.safetensors"))
               if not any(path.glob(pattern))]
    if missing:
        raise ConfigError(f"--hf-model {directory!r} has no {' and no '.join(missing)} (it holds "
                          f"{sorted(p.name for p in path.iterdir())[:8]}); expected a directory as "
                          f"save_pretrained writes it, with safetensors weights")
    return path


def build_hf_program(args):
    """This rank's ModuleProgram for the checkpoint of --hf-model under --plan, or under the plan
    rank 0 searches (module docstring); returns (program, plan, vocabulary size)."""
    from autoplan.api import parallelize
    from autoplan.cluster import parse_cluster
    from autoplan.plan import Plan

    plan = Plan.load(args.plan) if args.plan else None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cluster = plan.cluster if plan is not None else parse_cluster(args.cluster or f"1x{world}xcpu")
    program = parallelize(str(checkpoint_files(args.hf_model)), cluster, plan=plan, global_batch=args.global_batch,
                          seq_len=args.seq, timeout_s=args.timeout)
    if program.mesh.get_rank() == 0:
        from autoplan.cli.explain import describe_config

        print(f"plan: {describe_config(program.plan)}; global batch {program.plan.global_batch} x seq "
              f"{program.plan.seq_len}", flush=True)
    return program, program.plan, program.vocab


def finish_hf(args, program, next_batch, rank: int) -> float:
    """After the last step: the loss of the trained weights on `next_batch` (tokens, targets: the
    batch after the last step's), printed on rank 0, and with --save-hf the export; that loss."""
    from autoplan.runtime.hf_export import save_hf

    loss = program.eval_loss(*next_batch)
    if rank == 0:
        print(f"loss of the trained weights on the next batch (step {args.steps}): {loss:.6f}", flush=True)
    if args.save_hf:
        save_hf(program, args.save_hf)
        if rank == 0:
            print(f"wrote the fine-tuned checkpoint to {args.save_hf} "
                  f"(transformers.AutoModelForCausalLM.from_pretrained loads it)", flush=True)
    return loss
