"""A save's model-states files: the parameter shapes, the parallel sizes and the client state they record, and
what a folder's model states say of its layout (DP, EP, the rank files it needs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_ucp.deepspeed.optimizer_files import BF16_OPTIMIZER
from megatron_ucp.deepspeed.torch_files import load_raw
from megatron_ucp.deepspeed.versions import (
    BF16_LAST_RANK_PADDING_UNTIL,
    ZERO_PER_RANK_PADDING_SINCE,
)
from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.plan.conversion import ParamSpec
from megatron_ucp.plan.experts import (
    expert_facts,
    recorded_expert_parallel,
    recorded_experts,
)
from megatron_ucp.plan.geometry import PaddingStyle
from megatron_ucp.plan.parallel_layout import ParallelLayout
from megatron_ucp.plan.tensor_parallel import (
    TP_LAYOUT_KEY,
    MegatronPatterns,
    tp_pp_of_states,
)


@dataclass
class ModelStates:
    path: Path
    raw: dict
    param_groups: list[list[ParamSpec]]
    dp_world_size: Optional[int]
    ds_version: str
    universal_checkpoint_info: Optional[dict]

    @property
    def ds_config(self) -> dict:
        cfg = self.raw.get(F.DS_CONFIG)
        return cfg if isinstance(cfg, dict) else {}

    def parallel_dimensions(self, model_parallel: int) -> tuple[int, int]:
        """(TP, PP) of the run that saved this file (:func:`parallel_dimensions`)."""
        return parallel_dimensions(self.raw, self.path, model_parallel)

    def patterns(self, saved_tp: int = 1) -> MegatronPatterns:
        """Megatron's ``universal_checkpoint_info`` patterns of this save (at TP ``saved_tp``)."""
        info = self.universal_checkpoint_info or {}

        def listed(key: str) -> tuple[str, ...]:
            return tuple(info.get(key, ()) or ())

        return MegatronPatterns(
            vocabulary_patterns=listed(F.VOCABULARY_PARAMETER_PATTERNS),
            original_vocab_size=info.get(F.ORIGINAL_VOCAB_SIZE),
            replicated_patterns=listed(F.TP_REPLICATED_PARAMETER_PATTERNS),
            row_parallel_patterns=listed(F.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS),
            two_sub_param_patterns=listed(F.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0),
            saved_tp=saved_tp,
        )

    @property
    def tp_layout_record(self) -> Optional[dict]:
        """What megatron-ucp's save hook recorded of this rank's parameters' TP layouts, if anything."""
        recorded = self.raw.get(TP_LAYOUT_KEY)
        return recorded if isinstance(recorded, dict) else None

    def param_names(self) -> tuple[str, ...]:
        return tuple(spec.name for group in self.param_groups for spec in group)


def parallel_dimensions(raw: dict, path: Path, model_parallel: int) -> tuple[int, int]:
    """(TP, PP) of the run that saved a model-states dict, with ``model_parallel`` = TP x PP files.

    From DeepSpeed's ``checkpoint_parallel_dimensions`` (0.19+), else Megatron's saved ``args``
    (:func:`~megatron_ucp.plan.tensor_parallel.tp_pp_of_states`); neither, with one model-parallel
    rank: (1, 1). What is recorded must multiply to the number of model-parallel files.
    """
    recorded = tp_pp_of_states(raw)
    if recorded is None:
        if model_parallel == 1:
            return 1, 1
        raise CheckpointFormatError(
            f"{path}: {model_parallel} model-parallel ranks, but neither "
            f"{F.CHECKPOINT_PARALLEL_DIMENSIONS!r} nor Megatron's args say how they "
            "divide into TP and PP",
            subject=path,
        )
    tp, pp = recorded
    if tp * pp != model_parallel:
        raise CheckpointFormatError(
            f"{path}: records TP={tp} x PP={pp}, but the folder holds {model_parallel} model-parallel ranks' files",
            subject=path,
        )
    return tp, pp


def flatten_module_states(saved: Any, prefix: str = "") -> dict[str, Any]:
    """A model-states ``module`` dict as flat ``a.b.c`` names.

    Megatron-DeepSpeed saves the module through ``state_dict_for_save_checkpoint``, a dict of
    dicts (``{'language_model': {'encoder': {...}}}``); DeepSpeed's own save is already flat.
    """
    flat: dict[str, Any] = {}
    if not isinstance(saved, dict):
        return flat
    for key, value in saved.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_module_states(value, name + "."))
        else:
            flat[name] = value
    return flat


def with_leaves_replaced(nested: dict, values: dict[str, Any], prefix: str = "") -> dict:
    """A copy of a ``module`` dict (the same dict types, the same nesting, torch's ``_metadata``) with the leaves named
    in ``values`` (flat names, as :func:`flatten_module_states` gives them) replaced."""
    out = type(nested)()
    for key, value in nested.items():
        name = f"{prefix}{key}"
        out[key] = (
            with_leaves_replaced(value, values, name + ".") if isinstance(value, dict) else values.get(name, value)
        )
    if hasattr(nested, "_metadata"):  # torch's per-module versions, which load_state_dict hands each module
        out._metadata = nested._metadata  # type: ignore[attr-defined]
    return out


def _check_shapes_against_module(path: Path, groups: Sequence[Sequence[ParamSpec]], module: Any) -> None:
    """``param_shapes`` must agree with the module's own tensors where the file holds them: the
    output's shape comes from ``param_shapes``, and a transposed entry has the same element count."""
    saved = flatten_module_states(module)
    for group in groups:
        for spec in group:
            shape = getattr(saved.get(spec.name), "shape", None)
            if shape is not None and tuple(shape) == (0,) and spec.numel:
                continue  # ZeRO-3 saves its partitioned parameters as empty placeholders
            if shape is not None and tuple(int(d) for d in shape) != spec.shape:
                raise CheckpointFormatError(
                    f"{path}: param_shapes gives {spec.name!r} the shape {spec.shape}, but the "
                    f"saved module holds it as {tuple(int(d) for d in shape)}",
                    subject=path,
                )


def model_states_path(tag_dir: Path) -> Optional[Path]:
    """The tag's ``mp_rank_00_model_states.pt`` (or the first model-states file of another name; ZeRO-3: DP
    rank 0's ``zero_pp_rank_0_mp_rank_00_model_states.pt``), or None."""
    if (tag_dir / F.MODEL_STATES_FILE).is_file():
        return tag_dir / F.MODEL_STATES_FILE
    found = sorted(p for p in Path(tag_dir).glob("*_model_states.pt") if F.MODEL_FILE_RE.match(p.name))
    if found:
        return found[0]
    zero3 = Path(tag_dir) / F.zero3_model_file(0, 0)
    return zero3 if zero3.is_file() else None


def recorded_sizes(tag_dir: Path) -> tuple[Optional[int], Optional[int]]:
    """``dp_world_size`` and, for a mixture-of-experts save, the EP its model states record (one mapped read, no
    weight bytes); None for what the tag's model states (or their absence) do not say. A damaged file raises
    :class:`CheckpointFormatError`."""
    path = model_states_path(Path(tag_dir))
    if path is None:
        return None, None
    states = load_raw(path, random_access=True)
    dp = states.get(F.DP_WORLD_SIZE) if isinstance(states, dict) else None
    return (int(dp) if dp is not None else None), recorded_expert_parallel(states)


@dataclass(frozen=True)
class SavedLayout:
    """What the resume decision needs from a tag's first model-states file, read once (mapped, no
    weight bytes read)."""

    layout: Optional[ParallelLayout]
    """TP, PP and DP of the save; None when the file records no DP size."""
    param_names: frozenset[str]
    """The optimized parameters' names in that file (model-parallel rank 0's): the model class that saved it."""
    states: Optional[dict] = field(default=None, compare=False, repr=False)
    """The file's dict as read (tensors located, not read), for the reader's next questions."""
    per_parameter: bool = False
    """Saved at ZeRO stage 3 (every rank its own model states, each parameter partitioned on its own)."""
    path: Optional[Path] = None
    """The model-states file read."""


def saved_layout(tag_dir: Path) -> Optional[SavedLayout]:
    """DP, (TP, PP) (from the model states and the number of model-parallel files), parameter names and
    ZeRO-3-ness of a tag's save; None for a tag without model states. A damaged file raises
    :class:`CheckpointFormatError`."""
    path = model_states_path(Path(tag_dir))
    if path is None:
        return None
    raw = model_states_dict(path)
    per_parameter = F.ZERO3_MODEL_FILE_RE.match(path.name) is not None
    if per_parameter:  # each model-parallel rank's DP rank 0 file
        files = [p for p in Path(tag_dir).iterdir() if (m := F.ZERO3_MODEL_FILE_RE.match(p.name)) and m["dp"] == "0"]
    else:
        files = [p for p in Path(tag_dir).iterdir() if F.MODEL_FILE_RE.match(p.name)]
    names = frozenset(str(n) for g in param_shape_groups(raw) if isinstance(g, dict) for n in g)
    dp = raw.get(F.DP_WORLD_SIZE)
    tp, pp = parallel_dimensions(raw, path, max(1, len(files)))
    ep = _saved_ep(Path(tag_dir), int(dp)) if dp is not None and recorded_experts(raw.get("num_experts")) else 1
    layout = ParallelLayout(tp=tp, pp=pp, dp=int(dp), ep=ep) if dp is not None else None
    return SavedLayout(layout, names, raw, per_parameter, path)


def _saved_ep(tag_dir: Path, dp: int) -> int:
    """A mixture-of-experts save's EP from its partition counts; 1 when it has none (ZeRO-3, or experts partitioned
    over DP) or they do not add up (the reader says why)."""
    found = saved_partition_counts(tag_dir)
    experts = expert_facts((), found[1], dp) if found is not None else None
    return (experts.ep or 1) if experts is not None else 1


def saved_partition_counts(tag_dir: Path) -> Optional[tuple[Path, tuple[int, ...]]]:
    """The first ZeRO-1/2 rank file of a tag and its ``partition_count`` per param group (the pickle only: an
    expert group's is DP / EP); None without one."""
    first = next(iter(sorted(Path(tag_dir).glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))), None)
    raw = load_raw(first, random_access=True) if first is not None else None
    counts = raw.get(F.OPTIMIZER_STATE_DICT, {}).get(F.PARTITION_COUNT) if isinstance(raw, dict) else None
    return (first, tuple(int(c) for c in counts)) if isinstance(counts, (list, tuple)) else None


def rank_file_count_problem(
    tag_dir: Path, dp: int, like: Optional[str] = None, held: Sequence[str] = ()
) -> Optional[str]:
    """Whether the folder holds the ``dp`` optimizer files its model states say, of one model-parallel rank (``like``'s,
    a rank file's name; else rank 0's, any prefix); else which side is wrong (the files' own ``partition_count``
    breaks the tie), in words. None when they agree, or when the folder holds no such optimizer file at all.
    ``held``: names of files another node holds for this folder (a memory save's), counted as in it."""
    wanted = F.OPTIM_FILE_RE.match(like) if like is not None else None
    found = {}
    for path in [*Path(tag_dir).iterdir(), *(Path(tag_dir) / name for name in held)]:
        match = F.OPTIM_FILE_RE.match(path.name)
        if match is None or int(match["mp"]) != (int(wanted["mp"]) if wanted else 0):
            continue
        if wanted is None or match["prefix"] == wanted["prefix"]:
            found[int(match["dp"])] = path
    if not found or sorted(found) == list(range(dp)):
        return None
    mp = int(wanted["mp"]) if wanted else 0
    model = model_states_path(Path(tag_dir))
    first = found[min(found)]
    try:
        raw = load_raw(first)
        count = raw[F.OPTIMIZER_STATE_DICT].get(F.PARTITION_COUNT)
        saved_at = int(count[0] if isinstance(count, (list, tuple)) else count)
    except Exception:
        saved_at = None
    if saved_at == len(found) and sorted(found) == list(range(saved_at)):
        return (
            f"{model}: says DP={dp}, but the folder's {len(found)} rank files of model-parallel rank {mp} were "
            f"saved at DP={saved_at}: the model states of another save?"
        )
    extra = [found[r].name for r in sorted(found) if r >= dp]
    missing = [r for r in range(dp) if r not in found]
    says = model.name if model is not None else "the model states"
    if missing and not extra:
        prefix = F.OPTIM_FILE_RE.match(first.name).group("prefix") or ""
        name = f"{prefix}zero_pp_rank_{missing[0]}_mp_rank_{mp:02d}_optim_states.pt"
        more = f" (DP ranks {missing[:5]} have none)" if len(missing) > 1 else ""
        return f"{Path(tag_dir) / name}: is missing{more}; {says} says DP={dp}"
    detail = f"extra: {', '.join(extra[:3])}" if extra else f"missing DP ranks {missing[:5]}"
    return (
        f"{tag_dir}: {len(found)} rank files of model-parallel rank {mp} ({detail}), but {says} says DP={dp}: "
        "files of another save in the folder?"
    )


def model_states_dict(path: Path) -> dict:
    raw = load_raw(path, random_access=True)  # the pickle only: no readahead into the weights after it
    if not isinstance(raw, dict):
        raise CheckpointFormatError(f"{path}: not a DeepSpeed model-states dict", subject=path)
    return raw


def param_shape_groups(raw: dict) -> list:
    """``param_shapes`` as a list of groups (older DeepSpeed saved a single group as a bare dict)."""
    shapes = raw.get(F.PARAM_SHAPES) or []
    return [shapes] if isinstance(shapes, dict) else shapes


def read_model_states(path: Path, shapes_optional: bool = False) -> ModelStates:
    """``shapes_optional``: a mixture-of-experts save, whose model states lack ``param_shapes`` before
    DeepSpeed 0.19 (the reader derives the groups from the rank files, :func:`_derive_expert_save_groups`)."""
    raw = model_states_dict(path)
    shapes = param_shape_groups(raw)
    if not shapes and not shapes_optional:
        raise CheckpointFormatError(f"{path}: no '{F.PARAM_SHAPES}' (not saved by a ZeRO engine?)", subject=path)
    groups = []
    for g, group in enumerate(shapes):
        groups.append(
            [ParamSpec(name=str(name), group=g, shape=tuple(int(d) for d in shape)) for name, shape in group.items()]
        )
    _check_shapes_against_module(path, groups, raw.get("module"))
    dp = raw.get(F.DP_WORLD_SIZE)
    return ModelStates(
        path=path,
        raw=raw,
        param_groups=groups,
        dp_world_size=int(dp) if dp is not None else None,
        ds_version=str(raw.get(F.DS_VERSION, "")),
        universal_checkpoint_info=raw.get(F.UNIVERSAL_CHECKPOINT_INFO),
    )


def padding_style(kind: str, ds_version: str, saved_with_ucp: bool) -> PaddingStyle:
    """How the files' ``group_paddings`` were recorded (only used to predict stock behaviour)."""
    from packaging.version import Version

    if saved_with_ucp:
        return PaddingStyle.PER_RANK
    v = Version(Version(ds_version).base_version)
    if kind == BF16_OPTIMIZER:
        return PaddingStyle.LAST_RANK_ONLY if v <= BF16_LAST_RANK_PADDING_UNTIL else PaddingStyle.PER_RANK
    return PaddingStyle.PER_RANK if v >= ZERO_PER_RANK_PADDING_SINCE else PaddingStyle.LAST_RANK_ONLY


def recorded_save_id(tag_dir: Path) -> Optional[str]:
    """The save identity the tag's model states record; None when there are no model states or they record none (a
    save without the hooks). Raises :class:`CheckpointFormatError` when they cannot be read (one mapped read, no
    weight bytes)."""
    path = model_states_path(Path(tag_dir))
    if path is None:
        return None
    record = model_states_dict(path).get(F.UCP_SAVE_RECORD)
    save_id = record.get("save_id") if isinstance(record, dict) else None
    return str(save_id) if save_id is not None else None
