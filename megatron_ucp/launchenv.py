"""Which process am I, among how many, and how many share my node: the launchers' variables.

The one table of what torchrun/DeepSpeed, MPICH/PALS (``mpiexec`` on Aurora), PMIx, Open MPI and
Slurm export, read by the runner (DP-change planning before the launch), the hooks (one converter
per node), the distributed converter (rank and world size) and the background converter (which
drops them from its own environment). Pure: functions take the environment as a mapping.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

RANK = (
    ("RANK", "torchrun"),
    ("PMIX_RANK", "mpiexec (PMIx)"),
    ("PMI_RANK", "mpiexec (PMI)"),
    ("PALS_RANKID", "mpiexec (PALS)"),
    ("OMPI_COMM_WORLD_RANK", "mpirun (Open MPI)"),
    ("SLURM_PROCID", "srun (Slurm)"),
)
"""(variable, launcher) in the order they are believed."""
WORLD_SIZE = ("WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
LOCAL_RANK = (
    "LOCAL_RANK",
    "PALS_LOCAL_RANKID",
    "PMI_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "SLURM_LOCALID",
)
LOCAL_SIZE = (
    "LOCAL_WORLD_SIZE",
    "PALS_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "SLURM_NTASKS_PER_NODE",
)
JOB_ID = ("TORCHELASTIC_RUN_ID", "PALS_APID", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PBS_JOBID", "SLURM_JOB_ID")
PER_PROCESS = (
    *(name for name, _ in RANK),
    *WORLD_SIZE,
    *LOCAL_RANK,
    *LOCAL_SIZE,
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)
"""What describes one process of a job: a process spawned on its own (the background converter)
must not inherit it, or it would take itself for a rank of the training job."""


def first_int(env: Mapping[str, str], names: Sequence[str]) -> Optional[int]:
    """The first of ``names`` set to a non-negative integer in ``env``."""
    for name in names:
        text = env.get(name, "").strip()
        if text.isdigit():
            return int(text)
    return None


def rank(env: Mapping[str, str]) -> Optional[tuple[int, str]]:
    """(rank, launcher) or None when no launcher set one."""
    for name, launcher in RANK:
        value = first_int(env, (name,))
        if value is not None:
            return value, launcher
    return None


def world_size(env: Mapping[str, str]) -> Optional[int]:
    return first_int(env, WORLD_SIZE)


def local_rank(env: Mapping[str, str]) -> Optional[int]:
    return first_int(env, LOCAL_RANK)


def local_size(env: Mapping[str, str]) -> Optional[int]:
    """Processes per node (for one converter per node when ``ranks_per_node`` is not given)."""
    return first_int(env, LOCAL_SIZE)


def job_id(env: Mapping[str, str]) -> Optional[str]:
    """``NAME=value`` of the first job identifier set (Slurm steps get their step id appended)."""
    job = next((f"{n}={env[n]}" for n in JOB_ID if env.get(n)), None)
    if env.get("SLURM_STEP_ID") and job and job.startswith("SLURM_JOB_ID"):
        job += f".{env['SLURM_STEP_ID']}"
    return job
