"""Multi-host start-up: ``jax.distributed.initialize`` from the usual environment variables.

Read, in this order (the first complete set wins):
* JAX's own: ``JAX_COORDINATOR_ADDRESS`` (host:port of process 0), ``JAX_NUM_PROCESSES``,
  ``JAX_PROCESS_ID`` and optionally ``JAX_LOCAL_DEVICE_IDS`` ("0,1,2,3");
* torchrun style: ``MASTER_ADDR`` + ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` (``LOCAL_RANK`` is ignored:
  one process drives all GPUs of its host);
* a scheduler jax detects itself (SLURM ``SLURM_JOB_ID`` with ``SLURM_NTASKS``, Open MPI
  ``OMPI_COMM_WORLD_SIZE``): ``initialize()`` without arguments.
Nothing set (or a world of one process): single process, no initialisation. A partial set is an error
that names the missing variables.

Launch example, two hosts with 8 GPUs each, one process per host (mesh data=2 across the hosts):

    # host 0 (10.0.0.1)                              # host 1
    export JAX_COORDINATOR_ADDRESS=10.0.0.1:1234      export JAX_COORDINATOR_ADDRESS=10.0.0.1:1234
    export JAX_NUM_PROCESSES=2                        export JAX_NUM_PROCESSES=2
    export JAX_PROCESS_ID=0                           export JAX_PROCESS_ID=1
    deepinfer-jax convert --src /ckpt/V4.1-Flash --dst /shared/v41-orbax --mesh data=2,tensor=1,expert=8

Every process runs the same program; ``make_mesh`` puts ``data`` outermost so it is the axis that
crosses hosts (slots never exchange activations), and ``load_orbax`` reads on each host only the chunks
its own devices hold. (One 8-GPU host needs none of this: one process sees all 8 devices.)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

import jax

_JAX = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_TORCH = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


class DistributedConfigError(ValueError):
    """The environment names some of a distributed set-up's variables but not all, or bad values."""


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    coordinator_address: str | None  # None: let jax detect the cluster (SLURM / Open MPI)
    num_processes: int | None
    process_id: int | None
    local_device_ids: tuple[int, ...] | None = None
    source: str = "env"

    def kwargs(self) -> dict:
        out = {}
        if self.coordinator_address is not None:
            out.update(coordinator_address=self.coordinator_address, num_processes=self.num_processes,
                       process_id=self.process_id)
        if self.local_device_ids is not None:
            out["local_device_ids"] = list(self.local_device_ids)
        return out


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise DistributedConfigError(f"{key}={env[key]!r} is not an integer") from None


def spec_from_env(env: Mapping[str, str] | None = None) -> DistributedSpec | None:
    """The distributed set-up the environment describes, or None for a single process."""
    env = os.environ if env is None else env
    local = None
    if env.get("JAX_LOCAL_DEVICE_IDS"):
        try:
            local = tuple(int(x) for x in env["JAX_LOCAL_DEVICE_IDS"].split(","))
        except ValueError:
            raise DistributedConfigError(f"JAX_LOCAL_DEVICE_IDS={env['JAX_LOCAL_DEVICE_IDS']!r} is not a comma-"
                                         f"separated list of integers") from None
    for names, source in ((_JAX, "JAX_*"), (_TORCH, "MASTER_ADDR/WORLD_SIZE/RANK")):
        present = [n for n in names if env.get(n)]
        if not present:
            continue
        missing = [n for n in names if not env.get(n)]
        if missing:
            raise DistributedConfigError(f"{', '.join(present)} set but {', '.join(missing)} missing: set all of "
                                         f"{', '.join(names)} (or none)")
        if names is _JAX:
            addr, n, pid = env["JAX_COORDINATOR_ADDRESS"], _int(env, "JAX_NUM_PROCESSES"), _int(env, "JAX_PROCESS_ID")
            if ":" not in addr:
                raise DistributedConfigError(f"JAX_COORDINATOR_ADDRESS={addr!r} must be host:port")
        else:
            addr = f"{env['MASTER_ADDR']}:{_int(env, 'MASTER_PORT')}"
            n, pid = _int(env, "WORLD_SIZE"), _int(env, "RANK")
        if n < 1 or not 0 <= pid < n:
            raise DistributedConfigError(f"process id {pid} is not in [0, {n}) ({source})")
        if n == 1:
            return None
        return DistributedSpec(addr, n, pid, local, source)
    if env.get("SLURM_JOB_ID") and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return DistributedSpec(None, None, None, local, "SLURM")
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return DistributedSpec(None, None, None, local, "Open MPI")
    return None


def initialize_from_env(env: Mapping[str, str] | None = None) -> DistributedSpec | None:
    """Call ``jax.distributed.initialize`` once if the environment describes several processes.

    Must run before anything touches a jax device. -> the spec used, or None (single process)."""
    spec = spec_from_env(env)
    if spec is None:
        return None
    if jax.distributed.is_initialized():
        return spec
    if (env if env is not None else os.environ).get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
        # CPU processes (tests, CPU-only hosts) need an explicit collectives backend across processes.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**spec.kwargs())
    return spec


__all__ = ["DistributedSpec", "DistributedConfigError", "spec_from_env", "initialize_from_env"]
