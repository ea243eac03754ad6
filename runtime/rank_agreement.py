"""Small agreements between the ranks of the default process group, for work that one rank (or
each rank, on its share) does on files: a token they all use, the texts each produced, and the
first error any of them met, so that all raise together instead of some waiting forever in the
next collective. Texts travel as UTF-8 bytes in tensors (all_gather_object would pickle), on
`device` (the program's: CPU under gloo, CUDA under NCCL). Without a process group each function
answers for one rank.
"""

from __future__ import annotations

import secrets

import torch
import torch.distributed as dist


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the default group; (0, 1) without one."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_texts(text: str, device: torch.device) -> list[str]:
    """Every rank's `text` on every rank, in rank order: the byte lengths all-gathered, then the
    bytes padded to the longest."""
    if not dist.is_initialized():
        return [text]
    world = dist.get_world_size()
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    longest = max(int(n) for n in lengths)
    if longest == 0:  # nobody has anything to say: skip the second collective
        return [""] * world
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    pieces = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded)
    return [bytes(p[:int(n)].cpu().tolist()).decode() for p, n in zip(pieces, lengths)]


def first_error(message: str | None, device: torch.device) -> str | None:
    """The first non-empty `message` of any rank (in rank order), on every rank; None if none."""
    return next((text for text in gather_texts(message or "", device) if text), None)


def shared_token(device: torch.device) -> str:
    """One random 16-digit hex token, drawn by rank 0 and the same on every rank."""
    rank, _ = rank_world()
    value = torch.tensor([secrets.randbits(62) if rank == 0 else 0], dtype=torch.int64,
                         device=device)
    if dist.is_initialized():
        dist.broadcast(value, src=0)
    return f"{int(value):016x}"
