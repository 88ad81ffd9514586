"""Where this rank sits in tensor and pipeline parallelism at load time, and how TP divides a live parameter.

Read from the ``mpu`` DeepSpeed was given (Megatron's ``parallel_state``, or the pipeline engine's
grid) through DeepSpeed's own version-tolerant helpers, and from Megatron's per-parameter
``tensor_model_parallel`` / ``partition_dim`` attributes, which describe the model being loaded
into (the checkpoint's layout is the converter's business).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from megatron_ucp.deepspeed.reader import load_torch_file
from megatron_ucp.errors import CheckpointFormatError, PlanError
from megatron_ucp.format import dsformat as F
from megatron_ucp.integration.collectives import count_across, gather_names, is_first
from megatron_ucp.plan.names import is_pipeline_names, name_map
from megatron_ucp.plan.tensor_parallel import TpLayout

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in tensor parallelism at load time."""

    size: int = 1
    rank: int = 0


def tensor_parallel_of(optimizer: Any) -> TensorParallel:
    """TP size and rank from the optimizer's ``mpu`` (Megatron's, or DeepSpeed's pipeline grid)."""
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank, bwc_tensor_model_parallel_world_size

    mpu = getattr(optimizer, "mpu", None)
    if mpu is None:
        return TensorParallel()
    return TensorParallel(int(bwc_tensor_model_parallel_world_size(mpu)), int(bwc_tensor_model_parallel_rank(mpu)))


def live_tp_layout(lp: Any, entry: Any, tp: int, file_shape: tuple[int, ...]) -> TpLayout:
    """How TP divides the live parameter: Megatron's ``tensor_model_parallel`` / ``partition_dim``
    attributes (set at every TP size), the sub-parameter count and vocabulary flag from the file."""
    info = entry if isinstance(entry, dict) else {}
    sub = int(info.get(F.PARAM_N_SUB_PARAMS, 1) or 1)
    vocab = bool(info.get(F.VOCAB_TENSOR, False))
    if tp == 1:
        return TpLayout(sub_params=sub, vocab=vocab)
    if hasattr(lp, "tensor_model_parallel"):
        if not lp.tensor_model_parallel:
            return TpLayout(replicated=True, vocab=vocab)
        dim = int(getattr(lp, "partition_dim", info.get(F.CAT_DIM, 0)))
        return TpLayout(dim=0 if sub > 1 else dim, sub_params=sub, vocab=vocab)
    if tuple(lp.shape) == tuple(file_shape):  # no attributes: a slice as large as the whole is replicated
        return TpLayout(replicated=True, vocab=vocab)
    return TpLayout(dim=0 if sub > 1 else int(info.get(F.CAT_DIM, 0)), sub_params=sub, vocab=vocab)


def tp_layout_record(named_parameters: Any) -> Optional[dict[str, dict]]:
    """Each parameter's TP layout as the save hook records it (:data:`~megatron_ucp.plan.tensor_parallel.TP_LAYOUT_KEY`).

    From Megatron's ``tensor_model_parallel`` / ``partition_dim`` attributes, which it sets at every
    TP size, TP=1 included: what Megatron's ``universal_checkpoint_info`` only says at TP > 1. None
    when no parameter carries them (not a Megatron model: nothing to record).
    """
    params = list(named_parameters)
    if not any(hasattr(p, "tensor_model_parallel") for _, p in params):
        return None
    record = {}
    for name, p in params:
        split = bool(getattr(p, "tensor_model_parallel", False))
        dim = int(getattr(p, "partition_dim", 0)) if split else 0
        record[name] = TpLayout(replicated=not split, dim=max(dim, 0)).to_record()
    return record


def current_tp_pp(engine: Any) -> tuple[int, int]:
    """(TP, PP) of the running engine, from its ``mpu`` (Megatron's, or the pipeline grid)."""
    from deepspeed.utils.bwc import bwc_pipeline_parallel_world_size, bwc_tensor_model_parallel_world_size

    mpu = getattr(engine, "mpu", None)
    if mpu is None:
        return 1, 1
    return int(bwc_tensor_model_parallel_world_size(mpu)), int(bwc_pipeline_parallel_world_size(mpu))


@contextlib.contextmanager
def one_model_states_file_per_rank(engine: Any, always: bool = False) -> Iterator[None]:
    """For one load: each rank reads one existing ``mp_rank_XX_model_states.pt`` as it is, once.

    At another TP or PP size the folder holds another number of those files than the engine has
    model-parallel ranks, and DeepSpeed's state-dict loader then merges or splits the module weights
    Megatron-style (for inference; it asserts ``key: attention.dense.weight is not found`` on this
    fork's names) or, given one file, asserts that the count differs from the saved mp_world_size. In universal mode the module is not loaded from those files
    (weights come from the fp32 masters), only the client state, which every file holds alike.
    ``always``: also at the saved TP/PP size (the native reshard), where DeepSpeed's loader would read
    the same file twice on every rank (``check_ckpt_list`` loads the first file whole to compare
    its ``mp_world_size``): here each rank reads its own file once and the count is checked on it.
    """
    from deepspeed.runtime.state_dict_factory import SDLoaderFactory

    original = SDLoaderFactory.__dict__["get_sd_loader"]
    want = int(getattr(engine, "mp_world_size", 1) or 1)

    def get_sd_loader(ckpt_list: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(ckpt_list, list) and ckpt_list and (always or len(ckpt_list) != want):
            return ClientStateLoader(list(ckpt_list), kwargs.get("checkpoint_engine", args[0] if args else None),
                                     check_count=always and len(ckpt_list) == want)
        return original.__func__(ckpt_list, *args, **kwargs)

    SDLoaderFactory.get_sd_loader = staticmethod(get_sd_loader)
    try:
        yield
    finally:
        SDLoaderFactory.get_sd_loader = original


class ClientStateLoader:
    """Stands in for DeepSpeed's state-dict loader in a universal load at another TP/PP size: one
    existing model-states file per rank, read as it is (nothing merged or split)."""

    def __init__(self, ckpt_list: list, checkpoint_engine: Any, check_count: bool = False) -> None:
        self.ckpt_list = ckpt_list
        self.checkpoint_engine = checkpoint_engine
        self.check_count = check_count

    def load(self, mp_world_size: int, mp_rank: int, *args: Any, **kwargs: Any) -> tuple[str, Any, None]:
        path = self.ckpt_list[min(mp_rank * len(self.ckpt_list) // max(1, mp_world_size), len(self.ckpt_list) - 1)]
        if self.checkpoint_engine is not None:
            states = self.checkpoint_engine.load(path, map_location=lambda storage, loc: storage)
        else:
            states = load_torch_file(Path(path), mmap=False)
        saved = states.get("mp_world_size") if isinstance(states, dict) else None
        if self.check_count and saved is not None and saved != len(self.ckpt_list):
            raise CheckpointFormatError(f"{path}: saved with mp_world_size {saved}, but its folder holds "
                                        f"{len(self.ckpt_list)} model-states files", subject=path)
        return path, states, None


def saved_names(optimizer: Any, listing: dict[str, tuple[str, ...]], group: Any) -> Optional[dict[str, str]]:
    """Live name -> saved folder name when the checkpoint was saved by the other GPT model class
    (``GPTModel`` <-> ``GPTModelPipe``, :mod:`megatron_ucp.plan.names`); None when names match.
    Collective over ``group``: the pipeline model's names are only complete across its stages."""
    local = set(optimizer.param_names.values())
    if not count_across(0 if local <= set(listing) else 1, group):
        return None
    live = gather_names(local, group)
    try:
        mapping = name_map(live, listing)
    except PlanError as exc:
        raise CheckpointFormatError(f"the checkpoint's parameter names do not match the model's, and no name map "
                                    f"applies: {exc}", subject=str(exc)) from exc
    if mapping is not None and is_first(group):
        kinds = ("GPTModelPipe", "GPTModel") if is_pipeline_names(listing) else ("GPTModel", "GPTModelPipe")
        log.info("megatron-ucp: the checkpoint was saved by %s, the model is %s: %d parameter names mapped "
                 "(e.g. %s <- %s)", *kinds, len(mapping), *next(iter(sorted(mapping.items()))))
    return mapping
