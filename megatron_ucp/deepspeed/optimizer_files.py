"""One rank's ZeRO-1/2 optimizer file: its metadata as pure values, its tensors as flat mapped views.

Loaded without torch (:func:`~megatron_ucp.deepspeed.torch_files.load_raw`), so reading metadata touches no tensor
bytes; ZeRO-3 files are :class:`~megatron_ucp.deepspeed.stage3_files.Stage3RankFile`, opened by the same
:func:`open_rank_file`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from megatron_ucp.deepspeed.stage3_files import Stage3RankFile, is_stage3_state
from megatron_ucp.deepspeed.state_kinds import partition_scalars, sharded_states
from megatron_ucp.deepspeed.torch_files import load_raw
from megatron_ucp.deepspeed.versions import (
    check_file_version,
)
from megatron_ucp.errors import CheckpointFormatError, StockFormError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.rawtensor import RawTensor
from megatron_ucp.plan.conversion import Fragment, RankGroupLayout, RankLayout

log = logging.getLogger(__name__)

BF16_OPTIMIZER = "BF16_Optimizer"
ZERO_OPTIMIZER = "DeepSpeedZeroOptimizer"


def _load_rank_file(path: Path) -> dict:
    """A rank file's dict (tensors located, not read); damage torch would reject is warned about."""
    damage: list[str] = []
    raw = load_raw(path, damage)
    if damage:
        log.warning(
            "%s: damaged zip structure (%s): torch.load would reject it, so a native DeepSpeed load of "
            "this tag fails; megatron-ucp reads its records directly and is not affected",
            path,
            damage[0],
        )
    if not isinstance(raw, dict) or not isinstance(raw.get(F.OPTIMIZER_STATE_DICT), dict):
        raise CheckpointFormatError(
            f"{path}: no '{F.OPTIMIZER_STATE_DICT}' dict: not a ZeRO optimizer-state file", subject=path
        )
    return raw


def open_rank_file(path: Path, dp_rank: int) -> "RankFile | Stage3RankFile":
    """One optimizer-state file, read as its stage wrote it: ZeRO-1/2 (:class:`RankFile`) or ZeRO-3
    (:class:`~megatron_ucp.deepspeed.stage3_files.Stage3RankFile`); both answer the same questions."""
    raw = _load_rank_file(Path(path))
    if is_stage3_state(raw[F.OPTIMIZER_STATE_DICT]):
        return Stage3RankFile(path, dp_rank, raw)
    return RankFile(path, dp_rank, raw)


class RankFile:
    """One rank's ZeRO-1/2 ``*_optim_states.pt``: metadata as pure values, tensors as flat views (mmap)."""

    def __init__(self, path: Path, dp_rank: int, raw: Optional[dict] = None):
        self.path = Path(path)
        self.dp_rank = dp_rank
        raw = raw if raw is not None else _load_rank_file(self.path)
        self.raw = raw
        self.sd: dict = raw[F.OPTIMIZER_STATE_DICT]
        for key in (F.PARAM_SLICE_MAPPINGS, F.SINGLE_PARTITION_OF_FP32_GROUPS, F.BASE_OPTIMIZER_STATE):
            if key not in self.sd:
                raise CheckpointFormatError(
                    f"{self.path}: optimizer state lacks '{key}' (DeepSpeed too old to "
                    "record it, or not a ZeRO-1/2 file)",
                    subject=self.path,
                )
        self.ds_version = str(self.sd.get(F.DS_VERSION) or raw.get(F.DS_VERSION) or "")
        if not self.ds_version:
            raise CheckpointFormatError(f"{self.path}: no ds_version recorded", subject=self.path)
        check_file_version(self.ds_version, str(self.path))
        self.kind = ZERO_OPTIMIZER if F.ZERO_STAGE in self.sd else BF16_OPTIMIZER
        counts = self.sd.get(F.PARTITION_COUNT)
        self.partition_counts = list(counts) if isinstance(counts, (list, tuple)) else None
        self._group_states = self._split_base_state()

    @property
    def num_groups(self) -> int:
        return len(self.sd[F.PARAM_SLICE_MAPPINGS])

    def _split_base_state(self) -> list[dict]:
        """Per-group optimizer state dicts, from torch's state_dict or ZeRO's elastic list form."""
        base = self.sd[F.BASE_OPTIMIZER_STATE]
        n = self.num_groups
        if isinstance(base, dict) and "state" in base:
            states = base["state"]
            return [dict(states.get(g, {})) for g in range(n)]
        if isinstance(base, (list, tuple)) and len(base) == n:
            step = self.sd.get("base_optimizer_state_step")
            out = [dict(s) for s in base]
            if step is not None:
                for s in out:
                    s.setdefault(F.STEP_STATE, step)
            return out
        raise CheckpointFormatError(
            f"{self.path}: unrecognised base_optimizer_state layout ({type(base).__name__})", subject=self.path
        )

    def state_names(self, g: int) -> list[str]:
        """Sharded states of group ``g``, discovered from the data (``fp32`` plus the optimizer's)."""
        return sharded_states(self._group_states[g], self.path, g, "param group")

    def partition_scalars(self, g: int) -> list[tuple[str, Any]]:
        """Group ``g``'s states of one value per partition besides its step (name, raw value)."""
        return partition_scalars(self._group_states[g])

    def state_tensor(self, g: int, state: str) -> RawTensor:
        """The flat partition of one state of group ``g`` (a view of the mapped file)."""
        if state == "fp32":
            t = self.sd[F.SINGLE_PARTITION_OF_FP32_GROUPS][g]
        else:
            t = self._group_states[g][state]
        if not isinstance(t, RawTensor) or not t.is_contiguous():
            raise CheckpointFormatError(
                f"{self.path}: state {state!r} of param group {g} is not a contiguous tensor ({t!r:.80})",
                subject=self.path,
            )
        return t.reshape(-1)

    def step(self, g: int) -> Any:
        return self._group_states[g].get(F.STEP_STATE)

    def param_groups(self) -> list[dict]:
        base = self.sd[F.BASE_OPTIMIZER_STATE]
        if isinstance(base, dict) and F.PARAM_GROUPS in base:
            return base[F.PARAM_GROUPS]
        raise CheckpointFormatError(f"{self.path}: base optimizer state has no param_groups", subject=self.path)

    def group_paddings(self) -> Optional[list[int]]:
        value = self.sd.get(F.GROUP_PADDINGS)
        return [int(v) for v in value] if value is not None else None

    def layout(self) -> RankLayout:
        mappings = self.sd[F.PARAM_SLICE_MAPPINGS]
        paddings = self.group_paddings()
        true_lengths = self.sd.get(F.GROUP_TRUE_LENGTHS)
        align = self.sd.get(F.PARAM_ALIGNMENT_PADDINGS)
        groups = []
        for g in range(self.num_groups):
            frags = []
            for name, addr in mappings[g].items():
                try:
                    frags.append(Fragment(name=str(name), start=int(addr.start), numel=int(addr.numel)))
                except AttributeError as exc:
                    raise CheckpointFormatError(
                        f"{self.path}: param_slice_mappings entry for {name!r} has no start/numel", subject=self.path
                    ) from exc
            lengths = tuple((s, int(self.state_tensor(g, s).numel())) for s in self.state_names(g))
            groups.append(
                RankGroupLayout(
                    fragments=tuple(frags),
                    state_lengths=lengths,
                    recorded_padding=paddings[g] if paddings is not None and g < len(paddings) else None,
                    recorded_true_length=int(true_lengths[g]) if true_lengths is not None else None,
                    param_alignment_padding=int(sum(align[g])) if align is not None and g < len(align) else 0,
                    has_step=self.step(g) is not None,
                )
            )
        return RankLayout(rank=self.dp_rank, groups=tuple(groups), source=str(self.path))

    def common_state(self) -> dict:
        """What goes into the universal ``zero/optimizer_state.pt``: everything not sharded, plus param_groups."""
        per_rank = (*F.SHARDED_OPTIMIZER_KEYS, F.GROUP_TRUE_LENGTHS, F.ZERO_PARTITION_INFO)
        out = {k: v for k, v in self.sd.items() if k not in per_rank}
        out[F.PARAM_GROUPS] = self.param_groups()
        if F.GROUP_PADDINGS in out:  # a universal checkpoint holds no padding (as stock writes it)
            out[F.GROUP_PADDINGS] = [0] * len(out[F.GROUP_PADDINGS])
        return out


def optimizer_state(path: Path) -> dict:
    """The optimizer dict of an old rank file, its tensors located but not read (readahead off)."""
    sd = load_raw(path, random_access=True)
    optim = sd.get(F.OPTIMIZER_STATE_DICT) if isinstance(sd, dict) else None
    if isinstance(optim, dict) and isinstance(optim.get(F.BASE_OPTIMIZER_STATE), list):
        raise StockFormError(
            f"{path}: saved with zero_optimization.elastic_checkpoint (its optimizer states per group, without "
            "their padding or param groups): megatron-ucp does not read that form; DeepSpeed's own load does",
            subject=path,
        )
    if (
        not isinstance(optim, dict)
        or not isinstance(optim.get(F.BASE_OPTIMIZER_STATE), dict)
        or not isinstance(optim.get(F.SINGLE_PARTITION_OF_FP32_GROUPS), list)
    ):
        raise CheckpointFormatError(
            f"{path}: not a ZeRO-1/2 optimizer file (no {F.OPTIMIZER_STATE_DICT} with "
            f"{F.BASE_OPTIMIZER_STATE} and {F.SINGLE_PARTITION_OF_FP32_GROUPS})",
            subject=path,
        )
    return optim
