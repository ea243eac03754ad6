"""Runtime: turns a Plan into per-rank programs with collectives and runs them on torch.distributed."""
