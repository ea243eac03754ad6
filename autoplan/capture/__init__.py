"""Capture: a model -> a `CapturedGraph` (per node: shapes, dtypes, module path, FLOPs, bytes), and the
graph side of TAPAS folding (repeated blocks found by structure).

    graph.py        the records every later stage reads (no torch.fx)
    fx.py           torch.fx symbolic trace of autoplan's own models and hand-written modules
    shape_rules.py  shapes of leaf modules and pointwise ops by rule (planning never imports dynamo)
    hf.py           Hugging Face models through torch.export on meta; hf_convert.py groups and prices
                    the ATen nodes; hf_rules.py adds the strategy rules those graphs need
    blocks.py       repeated blocks found by a Weisfeiler-Lehman hash: the FoldedGraph

Importing this package imports the graph types only; `capture` and `trace_model` load torch.fx on
first use.
"""

from __future__ import annotations

from autoplan.capture.graph import (MATMUL_KINDS, OP_KINDS, CapturedGraph, GraphIndex, NodeInfo, TensorMeta,
                                    block_of, node_label)


def capture(*args, **kwargs) -> CapturedGraph:
    """`autoplan.capture.fx.capture`: trace and annotate a model (its docstring has the conventions)."""
    from autoplan.capture.fx import capture as _capture

    return _capture(*args, **kwargs)


def trace_model(model):
    """`autoplan.capture.fx.trace_model`: the leaf-aware symbolic trace."""
    from autoplan.capture.fx import trace_model as _trace

    return _trace(model)


__all__ = ["CapturedGraph", "GraphIndex", "MATMUL_KINDS", "NodeInfo", "OP_KINDS", "TensorMeta", "block_of",
           "capture", "node_label", "trace_model"]
