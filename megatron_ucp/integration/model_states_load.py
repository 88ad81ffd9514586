"""For one load, DeepSpeed's model-states loader replaced: each rank reads one existing
``mp_rank_XX_model_states.pt`` as it is, once (:func:`one_model_states_file_per_rank`).

The replacement goes through :func:`megatron_ucp.deepspeed.surface.scoped_replace` and is undone when
the load returns or raises.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from megatron_ucp.deepspeed import surface
from megatron_ucp.deepspeed.reader import load_raw, load_torch_file
from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.rawtensor import torch_views_from_raw

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
    something uses it (:mod:`megatron_ucp.integration.module_read` reads each of them once across the
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
            )
        layer_file = F.LAYER_FILE_RE.match(Path(path).name) is not None
        if layer_file and self.layer_hook is not None and isinstance(states, dict):
            states = self.layer_hook(Path(path), states)
        if self.read is not None and isinstance(states, dict) and not layer_file:
            self.read.path = Path(path)
            self.read.states = {k: v for k, v in states.items() if k != F.MODULE}
            self.read.module = states.get(F.MODULE)
        return path, states, None
