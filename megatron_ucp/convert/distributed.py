"""One conversion across many processes on many nodes (``torchrun`` or ``mpiexec``), committed once.

Every process converts share ``rank`` of ``world_size`` (a deterministic, byte-balanced slice of
the parameters: :func:`megatron_ucp.plan.conversion.share_of`) into the common staging folder; the last
share to finish writes the common files and commits, as with ``--share I/N`` (see
:mod:`megatron_ucp.convert.universal`). On top of that, processes agree through ``torch.distributed``
(a gloo group, CPU only):

* on one attempt id (rank 0's, unless ``--attempt-id`` is given), so all join one staging folder;
* on failure: a process that fails says so in the store, the others stop at their next parameter;
* on the end: a final collective, so every process exits only after the commit, with a common
  exit status (the worst of all: a failure anywhere fails everywhere). When the conversion failed,
  rank 0 removes the staging folder: nothing half-written is left for the next attempt to join.

Launch environments (:func:`detect_launch`): ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT``), MPICH/PALS ``mpiexec`` as on Aurora (``PMIX_RANK``/``PMI_RANK``/``PALS_RANKID``,
``PMI_SIZE`` or ``PALS_LOCAL_SIZE`` x nodes of ``$PBS_NODEFILE``), Open MPI
(``OMPI_COMM_WORLD_*``), Slurm ``srun`` (``SLURM_PROCID``/``SLURM_NTASKS``). Without
``MASTER_ADDR``/``MASTER_PORT`` (``mpiexec`` sets neither), rank 0 opens a TCP store on a free port
and publishes ``host port`` in a file next to the output (the file system all ranks write the
checkpoint to is shared by construction); the others read it and connect.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Optional

from megatron_ucp import launchenv
from megatron_ucp.convert.execute import convert, default_output, resolve_checkpoint
from megatron_ucp.convert.universal import staging_path
from megatron_ucp.errors import UcpError, described

log = logging.getLogger(__name__)

__all__ = ["LaunchEnv", "detect_launch", "convert_distributed", "DistributedConvertResult", "DistributedConvertError"]

DEFAULT_TIMEOUT_S = 3600.0


class DistributedConvertError(UcpError):
    """The distributed conversion failed on at least one process (all processes raise it)."""

    def __init__(self, message: str, exit_code: int = 2, **kwargs: Any):
        super().__init__(message, **kwargs)
        self.exit_code = exit_code


class _Aborted(UcpError):
    """Another process failed: this one stops (not the cause of the failure)."""


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    launcher: str
    local_rank: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    job_id: Optional[str] = None
    agent_store: bool = False
    """torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT (every worker is a client)."""


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name, "").strip()
    try:
        return int(value) if value else None
    except ValueError:
        return None


def _nodes_in_hostfile(env: Mapping[str, str]) -> Optional[int]:
    path = env.get("HOSTFILE") or env.get("PBS_NODEFILE")
    try:
        hosts = {line.strip() for line in Path(path).read_text().splitlines() if line.strip()} if path else set()
    except OSError:
        return None
    return len(hosts) or None


def detect_launch(env: Optional[Mapping[str, str]] = None) -> Optional[LaunchEnv]:
    """The launcher's rank and world size from the environment, or None when not launched by one."""
    env = os.environ if env is None else env
    found = launchenv.rank(env)
    if found is None:
        return None
    rank, launcher = found
    size = launchenv.world_size(env)
    if size is None and _int(env, "PALS_LOCAL_SIZE") is not None:  # PALS with PMIx: no size variable
        nodes = _nodes_in_hostfile(env)
        if nodes is not None:
            size = _int(env, "PALS_LOCAL_SIZE") * nodes
    if size is None:
        raise UcpError(
            f"launched by {launcher} (rank {rank}) but no world size in the environment "
            f"(looked for {', '.join(launchenv.WORLD_SIZE)}, PALS_LOCAL_SIZE x hosts of $PBS_NODEFILE)"
        )
    if not 0 <= rank < size:
        raise UcpError(f"rank {rank} out of range for world size {size} ({launcher})")
    local = launchenv.local_rank(env)
    job = launchenv.job_id(env)
    return LaunchEnv(
        rank=rank,
        world_size=size,
        launcher=launcher,
        local_rank=local,
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=_int(env, "MASTER_PORT"),
        job_id=job,
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
    )


# --- rendezvous --------------------------------------------------------------------------------------
def _rendezvous_file(output: Path, key: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)[:120]
    return output.parent / f".{output.name}.ucp-rendezvous-{safe}"


def _open_store(launch: LaunchEnv, output: Path, attempt_id: Optional[str], timeout: float) -> Any:
    """A TCPStore all ranks share: MASTER_ADDR/PORT when set (torchrun), else published by rank 0 in a file."""
    import torch.distributed as dist

    td = datetime.timedelta(seconds=timeout)
    if launch.master_addr and launch.master_port:
        is_master = launch.rank == 0 and not launch.agent_store
        return dist.TCPStore(
            launch.master_addr,
            launch.master_port,
            launch.world_size,
            is_master=is_master,
            timeout=td,
            wait_for_workers=False,
        )
    key = attempt_id or launch.job_id
    if not key:
        raise UcpError(
            "no MASTER_ADDR/MASTER_PORT and no launcher job id in the environment: pass --attempt-id "
            "(the same on every process) so the processes can find each other"
        )
    path = _rendezvous_file(output, key)
    if launch.rank == 0:
        store = dist.TCPStore("0.0.0.0", 0, launch.world_size, is_master=True, timeout=td, wait_for_workers=False)
        host = os.environ.get("MASTER_ADDR") or socket.gethostname()
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        tmp.write_text(f"{host} {store.port} {launch.world_size}\n")
        os.replace(tmp, path)
        log.info("rendezvous: rank 0 serves the store at %s:%d (published in %s)", host, store.port, path)
        return store
    deadline = time.monotonic() + timeout
    last_error: Optional[BaseException] = None
    while time.monotonic() < deadline:
        try:
            host, port, size = path.read_text().split()
            if int(size) != launch.world_size:
                raise UcpError(f"{path}: published for world size {size}, this process has {launch.world_size}")
            store = dist.TCPStore(
                host,
                int(port),
                launch.world_size,
                is_master=False,
                timeout=datetime.timedelta(seconds=min(30.0, timeout)),
            )  # a stale file fails fast
            store.set_timeout(td)
            return store
        except (OSError, ValueError, RuntimeError) as exc:  # not there yet, half-written, stale, refused
            last_error = exc
            time.sleep(0.2)
    raise UcpError(f"rendezvous: no store published in {path} within {timeout:.0f}s ({last_error})")


# --- the run ---------------------------------------------------------------------------------------------
@dataclass
class DistributedConvertResult:
    rank: int
    world_size: int
    output: Path
    committed_by: Optional[int]
    """The rank whose share committed (None if nothing was committed)."""
    local: Any = None
    """This process's :class:`~megatron_ucp.convert.execute.ConvertResult`."""
    shares: list[dict] = field(default_factory=list)
    """Per rank: ok, committed, params, bytes, seconds, host, error."""
    seconds: float = 0.0

    @property
    def bytes_written(self) -> int:
        return sum(int(s.get("bytes", 0)) for s in self.shares)

    def summary(self) -> str:
        hosts = len({s.get("host") for s in self.shares})
        return (
            f"converted {self.local.tag if self.local else '?'} with {self.world_size} processes on {hosts} "
            f"host(s): {sum(int(s.get('params', 0)) for s in self.shares)} params, "
            f"{self.bytes_written / 1e9:.2f} GB in {self.seconds:.2f}s, committed by rank {self.committed_by} "
            f"-> {self.output}"
        )


def _exit_code(exc: BaseException) -> int:
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return 2 if isinstance(exc, UcpError) else 1


def convert_distributed(
    options: Any, launch: Optional[LaunchEnv] = None, timeout: float = DEFAULT_TIMEOUT_S
) -> DistributedConvertResult:
    """Run this process's share of a conversion launched on ``launch.world_size`` processes.

    ``options`` is a :class:`~megatron_ucp.convert.execute.ConvertOptions`; its share fields are replaced by
    (rank, world size) and its attempt id, when None, by rank 0's. Returns on every process after
    the commit; raises :class:`DistributedConvertError` on every process when any failed.
    """
    import torch.distributed as dist

    launch = launch or detect_launch()
    if launch is None:
        raise UcpError(
            "--distributed: no launcher environment found (RANK/WORLD_SIZE from torchrun, PMI_RANK/"
            "PMI_SIZE or PALS_RANKID from mpiexec, OMPI_COMM_WORLD_* or SLURM_PROCID/SLURM_NTASKS)"
        )
    t0 = time.perf_counter()
    output = Path(options.output) if options.output is not None else None
    if output is None:
        output = default_output(resolve_checkpoint(options.source, options.tag))
    output = output.absolute()
    store = _open_store(launch, output, options.attempt_id, timeout)
    prefix = dist.PrefixStore("megatron-ucp", store)
    dist.init_process_group(
        "gloo",
        store=prefix,
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    try:
        if launch.rank == 0 and not (launch.master_addr and launch.master_port):
            try:
                _rendezvous_file(output, options.attempt_id or launch.job_id or "").unlink()
            except OSError:
                pass
        box = [options.attempt_id or (f"dist-{uuid.uuid4().hex[:12]}" if launch.rank == 0 else None)]
        dist.broadcast_object_list(box, src=0)
        attempt = box[0]
        log.info(
            "rank %d/%d (%s): converting share %d of %d, attempt %s",
            launch.rank,
            launch.world_size,
            launch.launcher,
            launch.rank,
            launch.world_size,
            attempt,
        )

        failed = threading.Event()
        stop_watch = threading.Event()

        def watch() -> None:  # another rank's failure: stop at the next parameter
            while not stop_watch.wait(1.0):
                try:
                    if prefix.check(["failed"]):
                        failed.set()
                        return
                except Exception:  # the store is gone: the final collective will tell
                    return

        watcher = threading.Thread(target=watch, name="ucp-dist-watch", daemon=True)
        watcher.start()
        user_progress = options.on_progress

        def on_progress(done: int, total: int) -> None:
            if failed.is_set():
                raise _Aborted("another process of the distributed conversion failed")
            if user_progress is not None:
                user_progress(done, total)

        mine = replace(
            options,
            output=output,
            share_index=launch.rank,
            share_count=launch.world_size,
            attempt_id=attempt,
            on_progress=on_progress,
        )
        local, info = None, {"rank": launch.rank, "host": socket.gethostname(), "ok": True}
        try:
            local = convert(mine)
            info.update(
                committed=local.committed,
                params=local.params,
                bytes=local.bytes_written,
                seconds=round(local.seconds, 3),
                skipped=local.skipped,
            )
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the other ranks
            aborted = isinstance(exc, _Aborted)
            info.update(ok=False, aborted=aborted, code=_exit_code(exc), error=described(exc))
            if not aborted:
                try:
                    prefix.set("failed", f"rank {launch.rank}: {described(exc)}")
                except Exception:
                    pass
            log.error("rank %d: %s", launch.rank, info["error"])
        finally:
            stop_watch.set()
            watcher.join(timeout=5)

        shares: list[Any] = [None] * launch.world_size
        dist.all_gather_object(shares, info)  # also the barrier: every rank is past its convert()
        bad = [s for s in shares if not s["ok"]]
        committed = [s["rank"] for s in shares if s.get("committed")]
        if not bad and not committed and not any(s.get("skipped") for s in shares):
            bad = [
                {
                    "rank": -1,
                    "code": 2,
                    "error": "every share finished but none committed (the shares' done "
                    "markers were not visible to the last one: a file system without coherent metadata?)",
                }
            ]
        if bad:
            if launch.rank == 0:
                shutil.rmtree(staging_path(output), ignore_errors=True)
            dist.barrier()
            causes = [s for s in bad if not s.get("aborted")] or bad
            msg = "; ".join(f"rank {s['rank']}: {s['error']}" for s in causes[:4])
            raise DistributedConvertError(
                f"distributed conversion of {output.name} failed on "
                f"{len(causes)} of {launch.world_size} processes: {msg}",
                exit_code=max(int(s.get("code", 2)) for s in causes),
                subject=output,
            )
        return DistributedConvertResult(
            rank=launch.rank,
            world_size=launch.world_size,
            output=output,
            committed_by=committed[0] if committed else None,
            local=local,
            shares=shares,
            seconds=time.perf_counter() - t0,
        )
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def launch_summary(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A one-line description of a detected launcher environment with more than one process, else None."""
    try:
        launch = detect_launch(env)
    except UcpError:
        return None
    if launch is None or launch.world_size <= 1:
        return None
    return f"{launch.launcher}: rank {launch.rank} of {launch.world_size}"
