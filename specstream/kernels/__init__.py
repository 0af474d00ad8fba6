"""Weights and kernels: quantized projections and their routing per step shape, the C++ CPU kernels and their build, OpenMP pools."""
