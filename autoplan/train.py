"""Train a model under a plan, one process per rank:

    torchrun --nproc-per-node 4 -m autoplan.train --model tiny-llama --plan plan.json --steps 50
    torchrun --nproc-per-node 2 -m autoplan.train --model tiny-gpt --global-batch 8 --seq 32 --steps 20

Without --plan, the plan is searched for the launched world (a `1xNxcpu` cluster on CPU, or
`--cluster`). `--save DIR` writes a checkpoint (model and optimizer state under full names and
shapes, through torch.distributed.checkpoint) at the end into DIR, which must be new, empty or an
earlier checkpoint of this model. With `--save-every N` it saves every N steps and at the end into
numbered folders DIR/step-NNNNNN instead, and `--keep K` keeps only the K newest of them (only
folders with autoplan's manifest are ever deleted). `--resume DIR` continues from a checkpoint,
saved under this plan or any other plan of the same model (given a folder of numbered ones, the
newest whose files verify); steps count on from the checkpoint's, so `--steps` is the total.
Data is a text file (`--data`, bytes mapped into the vocabulary) or synthetic tokens: a seeded
random sequence repeated with a fixed period, so the loss can fall. Rank 0 shows progress,
logs the loss and can draw the loss curve (`--loss-png`, needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from autoplan.cli.args import OneLineParser, existing_file, non_negative_int, positive_float, positive_int
from autoplan.errors import AutoplanError

SYNTHETIC_PERIOD = 97  # tokens; prime, so windows at different offsets differ


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="autoplan.train", description="Train a model under an autoplan plan (run under torchrun).")
    p.add_argument("--model", required=True, help="a known model name, e.g. tiny-llama")
    p.add_argument("--plan", help="a plan JSON file; searched for the launched world when absent")
    p.add_argument("--cluster", help="cluster for the search (default: 1 x WORLD_SIZE x cpu, or the plan's)")
    p.add_argument("--global-batch", type=positive_int, default=8, help="sequences per step (when searching)")
    p.add_argument("--seq", type=positive_int, default=32, help="tokens per sequence (when searching)")
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
    return search(config, cluster, args.global_batch, args.seq)


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


def train(args) -> list[float]:
    from autoplan.api import parallelize
    from autoplan.models import build_model, get_model_config

    check_checkpoint_args(args)
    config = get_model_config(args.model)
    plan = resolve_plan(args, config)
    program = parallelize(build_model(config, device="meta"), plan.cluster, plan=plan, seed=args.seed)
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=args.lr)
    start = program.load_checkpoint(args.resume)["step"] if args.resume else 0
    stream = token_stream(config.vocab, args.data, args.seed)
    rank = torch.distributed.get_rank()
    losses, saved_at = [], start if args.resume else None
    for step in _progress(range(start, args.steps), rank == 0):
        tokens, targets = batch_at(stream, step, plan.global_batch, plan.seq_len)
        losses.append(program.train_step(tokens, targets, optimizer))
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:5d}  loss {losses[-1]:.4f}", flush=True)
        if args.save and args.save_every and (step + 1) % args.save_every == 0:
            save_checkpoint(program, args, step + 1)
            saved_at = step + 1
    if args.save and saved_at != max(args.steps, start):
        save_checkpoint(program, args, max(args.steps, start))
    return losses


def _progress(steps, show: bool):
    if not show:
        return steps
    from rich.progress import track

    return track(steps, description="training", transient=True)


def write_outputs(args, losses: list[float]) -> None:
    if args.log_json:
        Path(args.log_json).write_text(json.dumps({"model": args.model, "losses": losses}))
    if args.loss_png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(len(losses)), losses)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"{args.model}: training loss")
        fig.tight_layout()
        fig.savefig(args.loss_png, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        losses = train(args)
    except AutoplanError as exc:
        print(f"autoplan.train: error: {exc}", file=sys.stderr)
        return 2
    if torch.distributed.get_rank() == 0:
        write_outputs(args, losses)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
