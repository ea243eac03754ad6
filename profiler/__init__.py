"""Hardware profiler: measures GEMMs, memory bandwidth and collectives on the local machine.

`autoplan profile` (see `profiler.cli`) writes a `HardwareProfile` JSON file; the cost model's
`calibration` module turns it into shape-dependent GEMM efficiencies and fitted link costs.
"""
