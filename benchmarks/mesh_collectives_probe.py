"""Which collectives a data-split mesh puts around mHC's Sinkhorn kernel (deviceless, no GPU needed).

    ../aotenv/bin/python benchmarks/mesh_collectives_probe.py      # the venv of compile_probe.py

Compiles one ``mhc.mixes`` call at the decode shape (64 slots, V4.1 widths) for two compile-only H200s
in a ``data=2`` mesh, with the Mosaic GPU Sinkhorn kernel, once as the model runs it on a mesh
(``ParallelContext.batch_local``: each device's own rows in a ``shard_map``) and once left to GSPMD.
GSPMD cannot split a Pallas call, so it gathers the rows to every device and runs the whole batch on
each; the check is that the first form has no collective at all. Exits 1 if it has one.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%?\S+ = .*? (all-gather|all-gather-start|all-reduce|all-reduce-start|"
                         r"all-to-all|collective-permute|collective-permute-start|reduce-scatter)\(", re.M)


def collectives(hlo_text: str) -> list[str]:
    return _COLLECTIVE.findall(hlo_text)


def main() -> int:
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from compile_probe import TARGET_CONFIG, resolve_as_cuda

    jax.config.update("jax_platforms", "cpu")
    topo = topologies.get_topology_desc(platform="cuda", target_config=TARGET_CONFIG.read_text(), topology="1x2x1")
    mesh = Mesh(np.array(topo.devices).reshape(2, 1, 1), ("data", "tensor", "expert"))
    resolve_as_cuda()
    from deepinfer_jax.model import mhc
    from deepinfer_jax.parallel import ParallelContext

    ctx = ParallelContext(mesh)
    rep = NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((64, 1, 4, 5120), jnp.bfloat16, sharding=NamedSharding(mesh, ctx.batch_spec(4)))
    fn = jax.ShapeDtypeStruct((24, 4 * 5120), jnp.float32, sharding=rep)
    base = jax.ShapeDtypeStruct((24,), jnp.float32, sharding=rep)
    scale = jax.ShapeDtypeStruct((3,), jnp.float32, sharding=rep)
    kw = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20, sinkhorn_impl="pallas_mosaic_gpu")
    found = {}
    for label, rows_local in (("batch_local", ctx.batch_local), ("GSPMD", None)):
        f = jax.jit(lambda x, fn, b, s, rl=rows_local: mhc.mixes(x, fn, b, s, rows_local=rl, **kw))
        found[label] = collectives(f.trace(x, fn, base, scale).lower().compile().as_text())
        print(f"{label}: {len(found[label])} collectives {sorted(set(found[label]))}")
    return 1 if found["batch_local"] else 0


if __name__ == "__main__":
    sys.exit(main())
