"""Hardware profiler: measures GEMMs, memory bandwidth and collectives on the local machine.

Empty until the profiler issue lands; the cost model uses the device presets of autoplan.cluster.
"""
