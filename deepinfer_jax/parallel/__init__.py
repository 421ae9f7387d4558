"""Running the model over a device mesh: expert parallelism (``moe_ep``), tensor-parallel attention
(``attention_tp``), fixed-order combines (``collectives``), the context that threads them through the
model (``context``) and multi-host start-up (``distributed``). The rules table is ``deepinfer_jax.sharding``.

Imports are lazy: ``parallel.distributed`` must be importable before anything touches a jax device
(the model modules build small constant arrays at import)."""

__all__ = ["ParallelContext", "sharded_step"]


def __getattr__(name):
    if name in __all__:
        from deepinfer_jax.parallel import context

        return getattr(context, name)
    raise AttributeError(f"module 'deepinfer_jax.parallel' has no attribute {name!r}")
