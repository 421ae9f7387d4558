"""deepinfer-jax: DeepSeek-V4.1-Flash offline batch inference in JAX."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing the package does not import jax
    if name in ("LLM", "RequestOutput"):
        from deepinfer_jax.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from deepinfer_jax.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
