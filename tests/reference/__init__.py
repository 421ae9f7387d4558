"""Independent float64 numpy oracle of the DeepSeek-V4.1-Flash forward pass (see numpy_v41.py).

Written from the architecture spec alone, without importing ``deepinfer_jax``, so that tests comparing the JAX model
against it are comparing two independent readings of the spec.
"""
