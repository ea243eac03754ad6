"""Hardware profiler: measures GEMMs, memory bandwidth, collectives and (on CUDA) the runtime's fused
Triton kernels on the local machine.

`autoplan profile` (see `profiler.cli`) writes a `HardwareProfile` JSON file; the cost model's
`calibration` module turns it into shape-dependent GEMM efficiencies and fitted link costs, and
`cost_model.kernels` into per-kernel HBM efficiencies.
"""
