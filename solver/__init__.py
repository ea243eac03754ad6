"""Solvers on plain arrays: the intra-op ILP and the outer search. Never imports torch.fx or the runtime."""
