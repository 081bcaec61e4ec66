"""Tools over the library: ``profiling`` (copy and collective counters, step
measurement) and ``simulate`` (one rank of an N-rank step on fake tensors), with the
model sources the simulator reads (``model_sources``)."""
