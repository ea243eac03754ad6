"""Train a model under a plan, one process per rank:

    torchrun --nproc-per-node 4 -m autoplan.train --model tiny-llama --plan plan.json --steps 50
    torchrun --nproc-per-node 2 -m autoplan.train --model tiny-gpt --global-batch 8 --seq 32 --steps 20
    torchrun --nproc-per-node 4 -m autoplan.train --hf-model my-llama --steps 40 --save-hf my-llama-tuned

`--hf-model DIR` fine-tunes a local Hugging Face checkpoint with the runtime for your own module
(`autoplan.train_hf`: what it runs and its loss; --save / --resume below work for it too).

Without --plan, the plan is searched for the launched world (a `1xNxcpu` cluster on CPU, or
`--cluster`), in bfloat16 under `--precision` (bf16-master unless autocast is given). `--save DIR` writes a checkpoint (model and optimizer state under full names and
shapes, through torch.distributed.checkpoint) at the end into DIR, which must be new, empty or an
earlier checkpoint of this model. With `--save-every N` it saves every N steps and at the end into
numbered folders DIR/step-NNNNNN instead, and `--keep K` keeps only the K newest of them (only
folders with autoplan's manifest are ever deleted). `--resume DIR` continues from a checkpoint,
saved under this plan or any other plan of the same model (given a folder of numbered ones, the
newest whose files verify); steps count on from the checkpoint's, so `--steps` is the total.
Data is a text file (`--data`, bytes mapped into the vocabulary) or synthetic tokens: a seeded
random sequence repeated with a fixed period, so the loss can fall. Rank 0 shows progress,
logs the loss and can draw the loss curve (`--loss-png`, needs matplotlib).

Faults end the run with one line on stderr and a non-zero exit status:

    2  bad input (a plan of another model, token ids outside the vocabulary, ...)
    3  the training diverged: a step whose global loss or gradient norm is not finite stops every
       rank before its optimizer step, naming the step and the first parameter whose gradient is
       not finite; its update is never taken and nothing is saved after it, so the checkpoint
       in --save stays the last one written before it (which holds the state that step started
       from if a save fell just before it: resume from it with a lower --lr)
    4  a collective failed: it waited longer than `--timeout` seconds (default 300; it also
       bounds how long the ranks wait for each other at startup) for a rank that stalled, or a
       rank died; the line names the collective, its ranks and the step

Restarts: under `torchrun --max-restarts N` a failed job is started again; a restarted run
(TORCHELASTIC_RESTART_COUNT > 0), or any run given `--auto-resume`, resumes from `--save DIR` when
that holds a complete checkpoint (else from `--resume`, else from scratch), so with `--save-every
K` it redoes at most K steps. (Across several nodes, launch with `--rdzv-backend c10d` and
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so that each attempt rendezvouses afresh: runtime.launch.)

Rank 0 logs each tenth step's loss, step time, tokens/s and MFU, and at the end the measured step time
(median, first step left out) against the plan's prediction, warning past 10% (`autoplan.step_meter`).
After the first step it logs the activation bytes one microbatch's forward leaves on the largest rank
against the plan's prediction, warning past 5% (`autoplan.train_memory`; not for pipelined plans).

`--log-json` is strict JSON: {"model", "first_step" (the step of losses[0]), "losses", and with
--hf-model "eval_loss" (the trained weights' loss on the next batch)}, a loss that
is not finite written as null (with a "note"), "stopped" (the error) when the run ended early, and
the timing: "step_times_s", "measured_step_time_s", "predicted_step_time_s", "tokens_per_s", "mfu".

Test hooks (rank 1, first attempt only): AUTOPLAN_TEST_KILL_AT_STEP=N exits the process at the
start of step N as a crash would; AUTOPLAN_TEST_STALL_AT_STEP=N makes it hang there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from autoplan.cli import exit_now
from autoplan.cli.args import OneLineParser, existing_file, non_negative_int, positive_float, positive_int
from autoplan.step_meter import StepMeter
from autoplan.train_hf import add_hf_options, build_hf_program, check_hf_args, finish_hf
from autoplan.errors import AutoplanError, CollectiveError, ConfigError, TrainingDivergedError
from autoplan.plan import PRECISIONS

SYNTHETIC_PERIOD = 97  # tokens; prime, so windows at different offsets differ


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="autoplan.train", description="Train a model under an autoplan plan (run under torchrun).")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="a known model name, e.g. tiny-llama")
    add_hf_options(p, model)  # --hf-model DIR, --save-hf OUT
    p.add_argument("--plan", help="a plan JSON file; searched for the launched world when absent")
    p.add_argument("--cluster", help="cluster for the search (default: 1 x WORLD_SIZE x cpu, or the plan's)")
    p.add_argument("--global-batch", type=positive_int, default=8, help="sequences per step (when searching)")
    p.add_argument("--seq", type=positive_int, default=32, help="tokens per sequence (when searching)")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="how the searched bfloat16 plan holds its weights (when searching for --model): bf16-master "
                   "(default: bf16 parameters, fp32 masters and gradient reduction) or autocast (fp32 parameters)")
    p.add_argument("--steps", type=non_negative_int, default=20)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--data", type=existing_file, help="a text file; default: synthetic tokens")
    p.add_argument("--save", help="save a checkpoint here at the end (and every --save-every steps)")
    p.add_argument("--save-every", type=non_negative_int, default=0,
                   help="also save every N steps, all into DIR/step-NNNNNN (0: only at the end, into DIR)")
    p.add_argument("--keep", type=non_negative_int, default=0,
                   help="with --save-every: keep only the newest K numbered checkpoints (0: all)")
    p.add_argument("--resume", help="continue from this checkpoint (saved under any plan of the model), "
                                    "or from the newest complete one in a folder of numbered checkpoints")
    p.add_argument("--auto-resume", action="store_true",
                   help="resume from --save DIR when it holds a complete checkpoint (implied on a "
                        "torchrun restart)")
    p.add_argument("--timeout", type=positive_float, default=300.0, metavar="SECONDS",
                   help="how long a collective waits for the other ranks before the job fails "
                        "(default 300)")
    p.add_argument("--log-json", help="rank 0 writes the per-step losses here")
    p.add_argument("--loss-png", help="rank 0 draws the loss curve here")
    return p


def token_stream(vocab: int, data: str | None, seed: int) -> torch.Tensor:
    """1-D int64 tokens: the file's bytes modulo the vocabulary, or a repeated seeded pattern."""
    if data:
        raw = Path(data).read_bytes()
        if len(raw) < 2:
            raise AutoplanError(f"data file {data!r} has {len(raw)} bytes; need at least one sequence + 1")
        return torch.tensor(list(raw), dtype=torch.int64) % vocab
    pattern = torch.randint(vocab, (SYNTHETIC_PERIOD,), generator=torch.Generator().manual_seed(seed))
    return pattern.repeat(64)


def batch_at(stream: torch.Tensor, step: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences i of step s start at ((s * batch + i) * seq) mod (len - seq - 1); targets shift by one."""
    span = len(stream) - seq - 1
    if span <= 0:
        raise AutoplanError(f"the data has {len(stream)} tokens, fewer than seq + 1 = {seq + 1}")
    starts = [((step * batch + i) * seq) % span for i in range(batch)]
    tokens = torch.stack([stream[s : s + seq] for s in starts])  # (B, T)
    targets = torch.stack([stream[s + 1 : s + seq + 1] for s in starts])  # (B, T)
    return tokens, targets


def resolve_plan(args, config):
    from autoplan.cluster import parse_cluster
    from autoplan.plan import Plan
    from autoplan.api import search

    if args.plan:
        return Plan.load(args.plan)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cluster = parse_cluster(args.cluster or f"1x{world}xcpu")
    return search(config, cluster, args.global_batch, args.seq, precision=args.precision)


def check_precision_args(args) -> None:
    """--precision chooses the precision of the plan train searches for --model; a plan file and the
    module runtime's search (--hf-model: the checkpoint in float32) fix their own."""
    if args.precision and (args.plan or args.hf_model):
        given = f"--plan {args.plan}" if args.plan else f"--hf-model {args.hf_model}"
        raise ConfigError(f"--precision {args.precision} with {given}: --precision applies only to the plan searched "
                          f"for --model without --plan; make the plan with `autoplan search ... --precision "
                          f"{args.precision} -o plan.json` and pass --plan plan.json, or leave --precision out")


def check_checkpoint_args(args) -> None:
    """Refuse --keep without numbered checkpoints before training, not at the first save."""
    if args.keep < 0 or (args.keep and not (args.save and args.save_every)):
        raise AutoplanError(f"--keep {args.keep}: expected a count >= 1 of numbered checkpoints "
                            f"to keep, with --save DIR --save-every N (or 0 to keep all)")


def save_checkpoint(program, args, step: int) -> None:
    """--save: into DIR, or with --save-every into DIR/step-NNNNNN keeping the newest --keep."""
    if not args.save_every:
        program.save_checkpoint(args.save, step=step)
        return
    from autoplan.runtime.checkpoint import save_in_series

    save_in_series(program, args.save, program.optimizer, step, keep=args.keep)


@dataclasses.dataclass
class Run:
    """What a run has done so far, kept when it stops early: losses[i] is step first_step + i."""

    losses: list[float] = dataclasses.field(default_factory=list)
    first_step: int = 0
    eval_loss: float | None = None  # --hf-model: the trained weights' loss on the next batch
    step: int | None = None  # the step running now
    meter: StepMeter | None = None  # step times against the plan's prediction


def build_program(args):
    """This rank's program, its plan and the vocabulary size: a zoo model (--model) from the seeded
    init, or a Hugging Face checkpoint (--hf-model: `autoplan.train_hf`)."""
    from autoplan.api import parallelize
    from autoplan.models import build_model, get_model_config

    if args.hf_model:
        return build_hf_program(args)
    config = get_model_config(args.model)
    plan = resolve_plan(args, config)
    program = parallelize(build_model(config, device="meta"), plan.cluster, plan=plan,
                          seed=args.seed, timeout_s=args.timeout)
    return program, plan, config.vocab


def train(args, run: Run | None = None) -> list[float]:
    check_hf_args(args)  # first: --hf-model DIR and --save-hf OUT checked before anything is built
    check_checkpoint_args(args)
    check_precision_args(args)
    run = run if run is not None else Run()
    program, plan, vocab = build_program(args)
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=args.lr)
    rank = torch.distributed.get_rank()
    resumed_at = _resume(args, program, rank)
    start = run.first_step = resumed_at or 0
    stream = token_stream(vocab, args.data, args.seed)
    losses, saved_at, meter = run.losses, resumed_at, StepMeter(plan)
    run.meter = meter
    for step in _progress(range(start, args.steps), rank == 0):
        run.step = step
        _test_fault(step, rank)
        tokens, targets = batch_at(stream, step, plan.global_batch, plan.seq_len)
        began = time.perf_counter()
        # raises before the optimizer step if the step diverged, so no save below sees its state
        losses.append(program.train_step(tokens, targets, optimizer))  # a float: the step has ended
        meter.add(time.perf_counter() - began)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(meter.line(step, losses[-1]), flush=True)
        if step == start and not args.hf_model:  # once, after the first step: the memory the plan promised
            _report_memory(program, plan, args, tokens, targets, rank)
        if args.save and args.save_every and (step + 1) % args.save_every == 0:
            save_checkpoint(program, args, step + 1)
            saved_at = step + 1
    run.step = None
    if args.save and saved_at != max(args.steps, start):
        save_checkpoint(program, args, max(args.steps, start))
    if args.hf_model:
        next_batch = batch_at(stream, args.steps, plan.global_batch, plan.seq_len)
        run.eval_loss = finish_hf(args, program, next_batch, rank)
    if rank == 0:
        _report_timing(meter)
    return losses


def _report_memory(program, plan, args, tokens: torch.Tensor, targets: torch.Tensor, rank: int) -> None:
    """Measured against predicted activation bytes (`autoplan.train_memory`), warning past 5%; every
    rank measures, rank 0 reports."""
    from autoplan.train_memory import OVER, memory_line
    from autoplan.models import get_model_config

    found = memory_line(program, plan, get_model_config(args.model), tokens, targets)
    if found is None or rank != 0:
        return
    line, over = found
    print(line, flush=True)
    if over:
        print(f"autoplan.train: warning: this run holds more activation memory than the plan predicts (more "
              f"than {OVER:.0%} above it); a plan that fits only just may not fit on the device", file=sys.stderr,
              flush=True)


def _report_timing(meter: StepMeter) -> None:
    """Measured against predicted step time, with a warning past StepMeter's tolerance."""
    text, differs = meter.summary()
    print(text, flush=True)
    if differs:
        print("autoplan.train: warning: the measured step time differs from the plan's prediction by more "
              "than 10%; `autoplan profile` on this machine and a plan made with --profile price it better",
              file=sys.stderr, flush=True)


def _resume(args, program, rank: int) -> int | None:
    """Load the checkpoint `resume_from` picks into the program; its step, or None if none."""
    resume = resume_from(args)
    if not resume:
        return None
    start = program.load_checkpoint(resume)["step"]
    if rank == 0 and resume != args.resume:
        print(f"resuming from {resume} at step {start}", flush=True)
    return start


def restart_count() -> int:
    """How many times torchrun has restarted this job (0 on its first attempt or without it)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def resume_from(args) -> str | None:
    """The checkpoint to start from: --save DIR when it holds a complete checkpoint and the run
    was restarted by torchrun or asked for --auto-resume (it is then the latest); else --resume."""
    if args.save and (args.auto_resume or restart_count() > 0):
        from autoplan.runtime.checkpoint import CheckpointError, read_metadata

        try:
            read_metadata(args.save)  # autoplan.json is written last: its presence = complete
            return args.save
        except CheckpointError:
            pass  # nothing saved yet
    return args.resume


def _test_fault(step: int, rank: int) -> None:
    """The test hooks of the module docstring: rank 1 dies or hangs at the start of a step, on
    torchrun's first attempt only (so a restarted job can finish)."""
    if rank != 1 or restart_count() > 0:
        return
    if os.environ.get("AUTOPLAN_TEST_KILL_AT_STEP", "").strip() == str(step):
        os._exit(9)  # no cleanup, no exception: as a crash or an OOM kill
    if os.environ.get("AUTOPLAN_TEST_STALL_AT_STEP", "").strip() == str(step):
        time.sleep(3600)


def _progress(steps, show: bool):
    if not show:
        return steps
    from rich.progress import track

    return track(steps, description="training", transient=True)


def log_record(args, run: Run, stopped: str | None = None) -> dict:
    """--log-json's content: non-finite losses as null (strict JSON has no NaN), with a note."""
    record = {"model": args.model or args.hf_model, "first_step": run.first_step,
              "losses": [loss if math.isfinite(loss) else None for loss in run.losses]}
    if run.eval_loss is not None:
        record["eval_loss"] = run.eval_loss if math.isfinite(run.eval_loss) else None
    if None in record["losses"]:
        record["note"] = "null: a loss that was not finite (NaN or infinite)"
    if stopped is not None:
        record["stopped"] = stopped
    if run.meter is not None:
        record |= run.meter.record()
    return record


def write_outputs(args, run: Run, stopped: str | None = None) -> None:
    if args.log_json:
        text = json.dumps(log_record(args, run, stopped), allow_nan=False)
        Path(args.log_json).write_text(text)
    if args.loss_png and run.losses:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(run.first_step, run.first_step + len(run.losses)), run.losses)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"{args.model or args.hf_model}: training loss")
        fig.tight_layout()
        fig.savefig(args.loss_png, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run = Run()
    try:
        train(args, run)
    except TrainingDivergedError as exc:  # every rank raises it together: rank 0 reports
        return _stop(args, run, str(exc), 3, report=_rank() == 0)
    except AutoplanError as exc:
        return _stop(args, run, str(exc), 2, report=True)
    except CollectiveError as exc:  # each rank knows its own wait: each reports
        return _stop(args, run, str(exc), 4, report=True)
    except RuntimeError as exc:
        if not _lost_peer(exc):
            raise
        detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        where = f"rank {_rank()}" + (f" at step {run.step}" if run.step is not None else "")
        return _stop(args, run, f"{where}: a collective of torch's failed: {detail}", 4,
                     report=True)
    if _rank() == 0:
        write_outputs(args, run)
    torch.distributed.barrier()  # no rank tears its groups down while another still uses them
    torch.distributed.destroy_process_group()
    return 0


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _lost_peer(exc: RuntimeError) -> bool:
    """Gloo's wording for a wait past the timeout or a peer gone, in torch's own collectives
    (FSDP2, pipeline sends, checkpoint barriers), which do not raise CollectiveError."""
    text = str(exc)
    return any(s in text for s in ("Timed out waiting", "Connection closed by peer",
                                   "Connection reset by peer"))


def _stop(args, run: Run, message: str, code: int, report: bool) -> int:
    """Report a fault in one line (and, on rank 0, what was logged so far); the exit status."""
    if report:
        print(f"autoplan.train: error: {message}", file=sys.stderr, flush=True)
    if _rank() == 0 and run.losses:
        write_outputs(args, run, stopped=message)
    return code


if __name__ == "__main__":
    exit_now(main())
