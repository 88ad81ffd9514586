"""One ZeRO-3 rank file (``[bf16_]zero_pp_rank_<d>_mp_rank_<m>_optim_states.pt``), read as metadata and
flat tensor views, with the same questions answered as a ZeRO-1/2 :class:`~megatron_ucp.deepspeed.reader.RankFile`.

What stage 3 saves (``DeepSpeedZeroOptimizer_Stage3._rigid_state_dict``, DeepSpeed 0.16 to 0.19): per
optimizer sub-group ``i`` (a param group cut by ``sub_group_size``), ``fp32_flat_groups[i]`` and the
wrapped optimizer's ``state[i]`` (``exp_avg``, ``exp_avg_sq``, ``step``), each one rank's partition of
the sub-group; ``param_groups`` of the wrapped optimizer list sub-group indices; ``partition_count``
is the DP size (one number). There is no fragment map: where each parameter sits follows from
``param_shapes`` of the model states (:mod:`megatron_ucp.plan.param_geometry`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_ucp.deepspeed.state_kinds import partition_scalars, sharded_states
from megatron_ucp.deepspeed.torch_files import load_raw
from megatron_ucp.deepspeed.versions import check_file_version
from megatron_ucp.errors import CheckpointFormatError, UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.rawtensor import RawTensor
from megatron_ucp.plan.conversion import RankGroupLayout, RankLayout

STAGE3_OPTIMIZER = "DeepSpeedZeroOptimizer_Stage3"
AUTOEP_PARTITION_GROUPS = "ds_zero_partition_groups"
"""Written by DeepSpeed's AutoEP (expert parallelism at stage 3): a layout this tool does not read."""


def is_stage3_state(sd: Any) -> bool:
    """Whether an optimizer state dict is ZeRO-3's (its fp32 partitions are ``fp32_flat_groups``)."""
    return isinstance(sd, dict) and F.FP32_FLAT_GROUPS in sd


class Stage3RankFile:
    """One rank's stage-3 optimizer file: sub-groups play the part param groups play at stages 1 and 2."""

    kind = STAGE3_OPTIMIZER

    def __init__(self, path: Path, dp_rank: int, raw: Optional[dict] = None):
        self.path = Path(path)
        self.dp_rank = dp_rank
        raw = raw if raw is not None else load_raw(self.path)
        sd = raw.get(F.OPTIMIZER_STATE_DICT) if isinstance(raw, dict) else None
        if not is_stage3_state(sd):
            raise CheckpointFormatError(f"{self.path}: not a ZeRO-3 optimizer-state file", subject=self.path)
        self.raw = raw
        self.sd: dict = sd
        if AUTOEP_PARTITION_GROUPS in sd:
            raise UnsupportedError(
                f"{self.path}: DeepSpeed AutoEP expert partitions ({AUTOEP_PARTITION_GROUPS}); not supported",
                subject=self.path,
            )
        self.ds_version = str(raw.get(F.DS_VERSION) or sd.get(F.DS_VERSION) or "")
        if not self.ds_version:
            raise CheckpointFormatError(f"{self.path}: no ds_version recorded", subject=self.path)
        check_file_version(self.ds_version, str(self.path))
        inner = sd.get(F.OPTIMIZER_STATE_DICT)
        if not isinstance(inner, dict) or not isinstance(inner.get("state"), dict):
            raise CheckpointFormatError(
                f"{self.path}: the wrapped optimizer's state_dict ('{F.OPTIMIZER_STATE_DICT}' with 'state') is missing",
                subject=self.path,
            )
        self._inner = inner
        flats = sd[F.FP32_FLAT_GROUPS]
        if not isinstance(flats, (list, tuple)):
            raise CheckpointFormatError(f"{self.path}: '{F.FP32_FLAT_GROUPS}' is not a list", subject=self.path)
        self._flats = list(flats)
        count = sd.get(F.PARTITION_COUNT)
        if isinstance(count, (list, tuple)):
            count = count[0] if count else None
        self.partition_counts = [int(count)] * len(self._flats) if count is not None else None
        states = inner["state"]
        self._group_states = [dict(states.get(g, {})) for g in range(len(self._flats))]
        extra = sorted(k for k in states if not (isinstance(k, int) and 0 <= k < len(self._flats)))
        if extra:
            raise CheckpointFormatError(
                f"{self.path}: optimizer state for sub-groups {extra}, but {len(self._flats)} fp32 partitions",
                subject=self.path,
            )

    @property
    def num_groups(self) -> int:
        """Optimizer sub-groups (``fp32_flat_groups``)."""
        return len(self._flats)

    def state_names(self, g: int) -> list[str]:
        return sharded_states(self._group_states[g], self.path, g, "sub-group")

    def partition_scalars(self, g: int) -> list[tuple[str, Any]]:
        return partition_scalars(self._group_states[g])

    def state_tensor(self, g: int, state: str) -> RawTensor:
        t = self._flats[g] if state == "fp32" else self._group_states[g][state]
        if not isinstance(t, RawTensor) or not t.is_contiguous():
            raise CheckpointFormatError(
                f"{self.path}: state {state!r} of sub-group {g} is not a contiguous tensor ({t!r:.80})",
                subject=self.path,
            )
        return t.reshape(-1)

    def step(self, g: int) -> Any:
        return self._group_states[g].get(F.STEP_STATE)

    def param_groups(self) -> list[dict]:
        groups = self._inner.get(F.PARAM_GROUPS)
        if not isinstance(groups, list):
            raise CheckpointFormatError(f"{self.path}: the wrapped optimizer has no param_groups", subject=self.path)
        return groups

    def group_paddings(self) -> Optional[list[int]]:
        return None

    def layout(self) -> RankLayout:
        """Per sub-group: the states' lengths and step (fragments follow from the geometry, not the file)."""
        recorded = self.sd.get(F.GROUP_TRUE_LENGTHS)
        groups = []
        for g in range(self.num_groups):
            lengths = tuple((s, int(self.state_tensor(g, s).numel())) for s in self.state_names(g))
            groups.append(
                RankGroupLayout(
                    fragments=(),
                    state_lengths=lengths,
                    recorded_true_length=int(recorded[g]) if recorded is not None and g < len(recorded) else None,
                    has_step=self.step(g) is not None,
                )
            )
        return RankLayout(rank=self.dp_rank, groups=tuple(groups), source=str(self.path))

    def common_state(self) -> dict:
        """``zero/optimizer_state.pt``: what stock's stage-3 universal loader reads (loss scaler, the
        wrapped optimizer's ``param_groups`` and each sub-group's ``step``), without the sharded tensors
        stock copies there from rank 0."""
        per_rank = (F.FP32_FLAT_GROUPS, F.GROUP_TRUE_LENGTHS, F.ZERO_PARTITION_INFO, F.UCP_SAVE_RECORD)
        out = {k: v for k, v in self.sd.items() if k not in per_rank and k != F.OPTIMIZER_STATE_DICT}
        steps = {
            g: {k: v for k, v in state.items() if not (isinstance(v, RawTensor) and v.dim() > 0)}
            for g, state in enumerate(self._group_states)
        }
        out[F.OPTIMIZER_STATE_DICT] = {**self._inner, "state": steps}
        out[F.PARAM_GROUPS] = self.param_groups()
        # ZeRO-3 files keep it beside the optimizer dict; a ZeRO-1/2 engine's load of the folder asserts on it
        out.setdefault(F.DS_VERSION, self.ds_version)
        return out


def sub_group_owners(param_groups: Any, count: int, path: Path) -> list[int]:
    """Each sub-group's param group, from the sub-group indices each param group of a stage-3 optimizer lists."""
    owners: dict[int, int] = {}
    for g, group in enumerate(param_groups if isinstance(param_groups, list) else []):
        for h in group.get("params", []) if isinstance(group, dict) else []:
            owners[int(h)] = g
    if sorted(owners) != list(range(count)):
        raise CheckpointFormatError(
            f"{path}: its param groups list sub-groups {sorted(owners)}, the model states {count}", subject=path
        )
    return [owners[h] for h in range(count)]


def model_states_of_another_save(paths: Sequence[Path], first: Path, model_id: str) -> list[str]:
    """ZeRO-3: every rank's model states (their counters, config and frozen slices) of the save ``first`` names."""
    mp = F.ZERO3_MODEL_FILE_RE.match(Path(first).name)
    out = []
    for path in paths:
        other = F.ZERO3_MODEL_FILE_RE.match(Path(path).name)
        if path == first or mp is None or other is None or other["mp"] != mp["mp"]:
            continue
        raw = load_raw(path, random_access=True)
        record = raw.get(F.UCP_SAVE_RECORD) if isinstance(raw, dict) else None
        theirs = record.get("save_id") if isinstance(record, dict) else None
        if theirs != model_id:
            out.append(
                f"{path}: of another save ({theirs or 'saved without the megatron-ucp record'}; {Path(first).name} "
                f"and the rank files are of save {model_id})"
            )
    return out


def stage3_optimizer_state(path: Path) -> dict:
    """A ZeRO-3 rank file's optimizer dict, tensors located but not read (readahead off)."""
    raw = load_raw(path, random_access=True)
    sd = raw.get(F.OPTIMIZER_STATE_DICT) if isinstance(raw, dict) else None
    inner = sd.get(F.OPTIMIZER_STATE_DICT) if isinstance(sd, dict) else None
    if not isinstance(sd, dict) or not isinstance(sd.get(F.FP32_FLAT_GROUPS), list) or not isinstance(inner, dict):
        raise CheckpointFormatError(
            f"{path}: not a ZeRO-3 optimizer file (no {F.OPTIMIZER_STATE_DICT} with {F.FP32_FLAT_GROUPS} and the "
            "wrapped optimizer's state): a file of another ZeRO stage?",
            subject=path,
        )
    return sd


def flat_view(path: Path) -> dict:
    """A ZeRO-3 rank file's optimizer dict under ZeRO-1/2's keys (fp32 partitions per sub-group, the wrapped
    optimizer's state per sub-group), for the per-file checks both stages share."""
    sd = stage3_optimizer_state(path)
    inner = sd[F.OPTIMIZER_STATE_DICT]
    view = {k: v for k, v in sd.items() if k not in (F.FP32_FLAT_GROUPS, F.OPTIMIZER_STATE_DICT)}
    view[F.SINGLE_PARTITION_OF_FP32_GROUPS] = sd[F.FP32_FLAT_GROUPS]
    view[F.BASE_OPTIMIZER_STATE] = {"state": inner.get("state", {}), "param_groups": inner.get(F.PARAM_GROUPS)}
    return view
