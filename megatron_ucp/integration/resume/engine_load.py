"""DeepSpeed's own ``load_checkpoint`` as every route calls it (its model-states loader and, at ZeRO-3, its optimizer
load replaced for one load, undone after), and the :class:`LoadOutcome` every route returns to the one finish.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from megatron_ucp.deepspeed import surface
from megatron_ucp.deepspeed.reader import load_raw, load_torch_file
from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.rawtensor import torch_views_from_raw
from megatron_ucp.integration.live_job import LiveJob
from megatron_ucp.plan.accounting import AccountingReport
from megatron_ucp.plan.reshard import Read

LayerHook = Callable[[Path, dict], dict]
"""A pipeline model's layer file (path, its state dict as read) -> the state dict its layer loads."""


@dataclass
class ClientStates:
    """What this rank's loader read, less the module weights: what the checks after the load need
    (counters, scheduler, config), so that they do not read the file a second time."""

    path: Optional[Path] = None
    states: Optional[dict] = None
    module: Any = None
    """The module dict as read (mapped tensors when lazy: reading it in full touches every byte)."""

    def of(self, path: Path) -> Optional[dict]:
        """The states read from ``path`` by this load; None when another file (or none) was read."""
        return self.states if self.path is not None and self.path == Path(path) else None


@contextlib.contextmanager
def one_model_states_file_per_rank(
    engine: Any,
    always: bool = False,
    lazy: bool = False,
    layer_hook: Optional[LayerHook] = None,
    path: Optional[Path] = None,
) -> Iterator[ClientStates]:
    """For one load: each rank reads one existing ``mp_rank_XX_model_states.pt`` as it is, once.

    At another TP or PP size the folder holds another number of those files than the engine has
    model-parallel ranks, and DeepSpeed's state-dict loader then merges or splits the module weights
    Megatron-style (for inference; it asserts ``key: attention.dense.weight is not found`` on this
    fork's names) or, given one file, asserts that the count differs from the saved mp_world_size. In universal
    mode the module is not loaded from those files
    (weights come from the fp32 masters), only the client state, which every file holds alike.
    ``always``: also at the saved TP/PP size (the native reshard), where DeepSpeed's loader would read
    the same file twice on every rank (``check_ckpt_list`` loads the first file whole to compare
    its ``mp_world_size``): here each rank reads its own file once and the count is checked on it.
    ``lazy``: the file is memory-mapped and only its pickle read; a tensor's bytes are read when
    something uses it (:mod:`megatron_ucp.integration.resume.module_read` reads each of them once across the
    job). ``layer_hook``: what a pipeline model's layer file (read lazily) gives its layer, by path (the
    optimized weights left alone, the rest read once across the DP group). ``path``: the file this rank
    reads, whatever DeepSpeed's names find (a ZeRO-3 rank beyond the saved DP size has no file of its own;
    a load across ZeRO stages finds the other stage's name). Yields what the replacement read of the
    model-states file, less the module weights (:class:`ClientStates`).
    """
    want = int(getattr(engine, "mp_world_size", 1) or 1)
    read = ClientStates()

    def make(original: Any) -> Any:
        def get_sd_loader(ckpt_list: Any, *args: Any, **kwargs: Any) -> Any:
            if path is not None:
                ckpt_list = [str(path)]
            if isinstance(ckpt_list, list) and ckpt_list and (always or path is not None or len(ckpt_list) != want):
                return ClientStateLoader(
                    list(ckpt_list),
                    kwargs.get("checkpoint_engine", args[0] if args else None),
                    check_count=always and path is None and len(ckpt_list) == want,
                    read=read,
                    lazy=lazy,
                    layer_hook=layer_hook,
                )
            return original.__func__(ckpt_list, *args, **kwargs)

        return staticmethod(get_sd_loader)

    with surface.scoped_replace(surface.SD_LOADERS, "get_sd_loader", make):
        yield read


class ClientStateLoader:
    """Stands in for DeepSpeed's state-dict loader in a universal load at another TP/PP size: one
    existing model-states file per rank, read as it is (nothing merged or split)."""

    def __init__(
        self,
        ckpt_list: list,
        checkpoint_engine: Any,
        check_count: bool = False,
        read: Optional[ClientStates] = None,
        lazy: bool = False,
        layer_hook: Optional[LayerHook] = None,
    ) -> None:
        self.ckpt_list = ckpt_list
        self.checkpoint_engine = checkpoint_engine
        self.check_count = check_count
        self.read = read
        self.lazy = lazy
        self.layer_hook = layer_hook

    def load(self, mp_world_size: int, mp_rank: int, *args: Any, **kwargs: Any) -> tuple[str, Any, None]:
        path = self.ckpt_list[min(mp_rank * len(self.ckpt_list) // max(1, mp_world_size), len(self.ckpt_list) - 1)]
        if self.lazy:  # the pickle only: tensors mapped, read when used
            # our own reader, readahead off: torch.load(mmap=True) advises the file sequential, after
            # which the kernel reads it whole at the first exact read of a slice
            states = torch_views_from_raw(load_raw(Path(path), random_access=True))
        elif self.checkpoint_engine is not None:
            states = self.checkpoint_engine.load(path, map_location=lambda storage, loc: storage)
        else:
            states = load_torch_file(Path(path), mmap=False)
        saved = states.get("mp_world_size") if isinstance(states, dict) else None
        if self.check_count and saved is not None and saved != len(self.ckpt_list):
            raise CheckpointFormatError(
                f"{path}: saved with mp_world_size {saved}, but its folder holds "
                f"{len(self.ckpt_list)} model-states files",
                subject=path,
                damaged=path,
            )
        layer_file = F.LAYER_FILE_RE.match(Path(path).name) is not None
        if layer_file and self.layer_hook is not None and isinstance(states, dict):
            states = self.layer_hook(Path(path), states)
        if self.read is not None and isinstance(states, dict) and not layer_file:
            self.read.path = Path(path)
            self.read.states = {k: v for k, v in states.items() if k != F.MODULE}
            self.read.module = states.get(F.MODULE)
        return path, states, None


@dataclass(frozen=True)
class CopiedFrom:
    """Where a native reshard's copy took this rank's partitions from: its reads per live partition (the order
    :func:`~megatron_ucp.integration.live_job.live_groups` gives) and old position -> rank file (a NaN found after
    the load names the file it came from)."""

    reads: Sequence[Sequence[Read]]
    rank_file: Callable[[int], Path]


@dataclass
class LoadOutcome:
    """What one route's load gives the finish: DeepSpeed's result and, when the route accounted for the tensors,
    the report and what the finish checks against (none for a same-DP restart, which checks what DeepSpeed loaded
    itself)."""

    result: Any
    load_path: Optional[Path] = None
    """The model-states file DeepSpeed loaded (its result's first element)."""
    report: Optional[AccountingReport] = None
    dp_from: Optional[int] = None
    restore_module: bool = False
    """Universal mode: restore the module tensors DeepSpeed skips (buffers, frozen parameters)."""
    states: Optional[dict] = None
    """What the load already read from ``load_path`` less the module (else the finish maps the file)."""
    origins: Optional[CopiedFrom] = None
    """A native reshard's: where each partition was copied from."""
    stock: bool = False
    """DeepSpeed's own load of a form the hooks do not read: what it loaded is left as stock leaves it."""


def loaded_path(result: Any) -> Optional[Path]:
    """The model-states file DeepSpeed's ``load_checkpoint`` says it loaded (None: it loaded nothing)."""
    return Path(result[0]) if isinstance(result, tuple) and result[0] is not None else None


def model_states_for(job: LiveJob, folder: Path) -> Optional[Path]:
    """The model-states file this rank reads from ``folder`` when DeepSpeed's own name for it is not there
    (None: DeepSpeed finds its own). A ZeRO-3 rank beyond the saved DP size reads DP rank 0's; a load
    across ZeRO stages reads the other stage's file of its model-parallel rank (universal mode reads only
    the client state from it, which every file holds alike)."""
    own = Path(surface.model_states_file(job.engine, str(folder.parent), folder.name))
    if own.is_file():
        return None
    mp = F.mp_rank_of(own.name)
    for name in (F.zero3_model_file(0, mp), f"mp_rank_{mp:02d}_model_states.pt"):
        if (folder / name).is_file():
            return folder / name
    return None


def replacing_optimizer_load(load: Callable[[Callable[..., bool], Any, str, str, bool], bool]) -> Any:
    """For one load of a ZeRO-3 engine, ``_load_zero_checkpoint`` replaced by ``load(original, engine, load_dir, tag,
    load_optimizer_states)``: DeepSpeed's stage-3 optimizer load reads this rank's own rank file (and refuses
    another DP size) or, in universal mode, every parameter's whole state files on every rank."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def _load_zero_checkpoint(self: Any, load_dir: str, tag: str, load_optimizer_states: bool = True) -> bool:
            return load(original, self, load_dir, tag, load_optimizer_states)

        return _load_zero_checkpoint

    return surface.scoped_replace(surface.ENGINE, "_load_zero_checkpoint", make)


@contextlib.contextmanager
def universal_mode(engine: Any, lazy: bool = False, path: Optional[Path] = None) -> Iterator[ClientStates]:
    """Set the engine's ``load_universal`` flag for one load; restore it whatever happens. At another
    TP/PP size each rank reads one model-states file as it is (:func:`one_model_states_file_per_rank`);
    ``lazy``: at any size, and only its pickle (universal mode loads no module weights from it); ``path``:
    the file to read where DeepSpeed's own name finds none (a folder converted from another ZeRO stage). Yields what
    the load read of the model-states file (:class:`ClientStates`)."""
    cfg = surface.engine_config(engine)
    before = cfg.load_universal_checkpoint
    cfg.load_universal_checkpoint = True
    try:
        with one_model_states_file_per_rank(engine, always=lazy, lazy=lazy, path=path) as read:
            yield read
    finally:
        cfg.load_universal_checkpoint = before
