"""Which DeepSpeed versions this package knows, for hooks (runtime internals) and for files.

Hooks patch named functions of DeepSpeed; they are written against specific versions and refuse
any other one loudly rather than misbehave. Checkpoint *files* are read by their recorded
``ds_version``; the on-disk ZeRO-1/2 layout has been stable across the range below.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from packaging.version import Version

from megatron_ucp.errors import UnsupportedError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Internals:
    """How one DeepSpeed release differs in what the hooks touch. The one place that says so.

    Everything else the hooks patch or read is the same in every release below (checked against
    each one's source and exercised by the version matrix in the Makefile):
    ``DeepSpeedEngine.load_checkpoint`` / ``save_checkpoint`` signatures, ``ZeROOptimizer.
    load_hp_checkpoint_state_from_checkpoint_dir`` shared by ``BF16_Optimizer`` and
    ``DeepSpeedZeroOptimizer``, ``_hp_mapping`` (``lp_fragment_address``, ``optim_fragment``),
    ``real_dp_process_group``, ``nccl_start_alignment_factor``, ``mpu`` on both optimizers and
    ``deepspeed.utils.bwc``'s TP/PP helpers, ``DeepSpeedEngine._save_checkpoint(save_dir, tag,
    client_state, exclude_frozen_parameters)`` (the TP layout record), ``SDLoaderFactory.get_sd_loader``
    imported inside ``_load_checkpoint`` (replaced for one universal load at another TP/PP size),
    ``checkpoint_parallel_dimensions`` in model states from 0.19 on (Megatron's ``args`` before),
    and the ZeRO-1/2 file layout
    (whose one difference, DeepSpeedZeroOptimizer's per-rank ``group_paddings`` from 0.16.4 on, is a
    file fact: ``ZERO_PER_RANK_PADDING_SINCE`` below).
    """

    decoupled_commit: bool
    """``DeepSpeedEngine._commit_decoupled_checkpoint`` exists (decoupled checkpoint engines): the
    async trigger must wait for that commit, not for ``save_checkpoint``'s return."""
    ships_compression: bool
    """``deepspeed.compression.compress`` exists; Megatron-DeepSpeed's ``megatron/training.py``
    imports it, so without it the ALCF fork does not start unedited."""
    bf16_optimizer_selected: bool = True
    """bf16 + ZeRO-1 + ``data_types.grad_accum_dtype: fp32`` gets ``BF16_Optimizer``. In 0.17.x
    ``constants.DDP_BFLOAT16 == BFLOAT16 == "bf16"``, so the engine's dispatch takes that config
    for plain DDP bf16 and builds ``FP16_UnfusedOptimizer``: no ZeRO partitioning at all (a
    DeepSpeed bug, fixed in 0.18). The hooks leave such engines to DeepSpeed."""
    zero_trains_padding_only_rank: bool = True
    """Stock DeepSpeedZeroOptimizer trains when a rank's partition of a group is all padding. 0.17.x
    dies in its first backward (``get_flat_partition`` reads ``tensor_list[0]`` of an empty list):
    AuroraGPT-7B at DP=768 (ranks 766, 767) cannot train with it at all."""
    bf16_dp_invariant: bool = True
    """BF16_Optimizer training gives the same losses at any DP size (to bf16 reduction noise). Not in
    0.18.9: two uninterrupted runs of the same Megatron-DeepSpeed job, without megatron-ucp, at DP=3
    and DP=4 report different gradient norms from the first step (0.886 vs 0.985) and losses 4e-4
    apart by the third, so a resume at another DP size can only match the old curve that closely."""
    saves_fork_moe: bool = True
    """A mixture-of-experts save of the ALCF fork's ``GPTModel`` works. From 0.19,
    ``_save_moe_checkpoint`` calls ``dict()`` on the module's ``universal_checkpoint_info``, which that
    model defines as a method: the save dies inside DeepSpeed (``TypeError: 'method' object is not
    iterable``) without megatron-ucp; the hooks hand it the info as it wants (``integration/save/experts.py``)."""
    zero_trains_with_torch_2_13: bool = True
    """Stock DeepSpeedZeroOptimizer's step works with torch 2.13 (the torch this project tests
    with). 0.18.9's ``all_gather_into_tensor_dp_groups`` writes into ``torch.split`` views, which
    torch 2.13 refuses ("Output 0 of Split is a view and is being modified inplace")."""


# Releases whose optimizer/engine internals the hooks were written and tested against, one per
# release line users run (the DP=768 report ran 0.16.x; Aurora environments carry 0.16 to 0.19).
INTERNALS = {
    "0.16.2": Internals(decoupled_commit=False, ships_compression=True),
    "0.16.9": Internals(decoupled_commit=False, ships_compression=True),
    "0.17.6": Internals(
        decoupled_commit=True,
        ships_compression=True,
        bf16_optimizer_selected=False,
        zero_trains_padding_only_rank=False,
    ),
    "0.18.9": Internals(
        decoupled_commit=True, ships_compression=True, bf16_dp_invariant=False, zero_trains_with_torch_2_13=False
    ),
    "0.19.5": Internals(decoupled_commit=True, ships_compression=True, saves_fork_moe=False),
    "0.19.8": Internals(decoupled_commit=True, ships_compression=False, saves_fork_moe=False),
}
HOOKS_TESTED_DEEPSPEED = tuple(INTERNALS)


@dataclass(frozen=True)
class MoeFiles:
    """How a release writes a DeepSpeed-MoE save (``_save_moe_checkpoint``) differently from the others."""

    expert_optimizer_files: bool
    """``expp_rank_<r>_mp_rank_<m>_optim_states.pt`` (``{'optimizer': None}`` under ZeRO) are written."""
    common_state: bool
    """The model states carry the dense save's keys (``param_shapes``, ``ds_config``, ...) and
    ``ds_autoep_layers``; else only the module, the counters and ``num_experts`` (no ``param_shapes``)."""
    clones_module: bool
    """The model states' tensors are cloned before the save (each its own storage), not views of the flat
    buffers."""


@dataclass(frozen=True)
class SavedFiles:
    """What one release writes differently from the others: the synthetic-checkpoint writer follows
    it, and ``tests/system/test_synthetic_checkpoint.py`` holds it to a real save of each release."""

    zero_per_rank_padding: bool
    """DeepSpeedZeroOptimizer's ``group_paddings`` is the per-rank clamp (else ``P - N`` on the last rank)."""
    param_alignment_paddings: bool
    """DeepSpeedZeroOptimizer files carry ``param_alignment_paddings`` (per-parameter padding lists)."""
    parallel_dimensions: bool
    """Model states carry ``checkpoint_parallel_dimensions`` (``tp_degree``, ``pp_degree``)."""
    sparse_tensor_module_names: bool
    """Model states carry ``sparse_tensor_module_names``."""
    universal_checkpoint_version: float = 0.2
    """``deepspeed.checkpoint.constants.UNIVERSAL_CHECKPOINT_VERSION_VALUE`` (Megatron records it)."""
    recovery_scripts: tuple[str, ...] = ("zero_to_fp32.py",)
    """Scripts the engine copies next to ``latest``."""
    moe: Optional[MoeFiles] = None
    """How it writes a mixture-of-experts save (held to a real save of the fork where it trains one:
    ``tests/integration``); None: not recorded."""


_MOE_BEFORE_0_17 = MoeFiles(expert_optimizer_files=True, common_state=False, clones_module=False)
_MOE_0_17 = MoeFiles(expert_optimizer_files=True, common_state=False, clones_module=True)
"""0.17.x and 0.18.x (``clone_tensors_for_torch_save``; 0.18.9's from its source: the fork takes no MoE step there)."""
_MOE_0_19 = MoeFiles(expert_optimizer_files=False, common_state=True, clones_module=True)


SAVED_FILES = {
    "0.16.2": SavedFiles(
        zero_per_rank_padding=False,
        param_alignment_paddings=False,
        parallel_dimensions=False,
        sparse_tensor_module_names=True,
        moe=_MOE_BEFORE_0_17,
    ),
    "0.16.9": SavedFiles(
        zero_per_rank_padding=True,
        param_alignment_paddings=False,
        parallel_dimensions=False,
        sparse_tensor_module_names=True,
        moe=_MOE_BEFORE_0_17,
    ),
    "0.17.6": SavedFiles(
        zero_per_rank_padding=True,
        param_alignment_paddings=False,
        parallel_dimensions=False,
        sparse_tensor_module_names=True,
        moe=_MOE_0_17,
    ),
    "0.18.9": SavedFiles(
        zero_per_rank_padding=True,
        param_alignment_paddings=False,
        parallel_dimensions=False,
        sparse_tensor_module_names=True,
        moe=_MOE_0_17,
    ),
    "0.19.5": SavedFiles(
        zero_per_rank_padding=True,
        param_alignment_paddings=False,
        parallel_dimensions=True,
        sparse_tensor_module_names=True,
        universal_checkpoint_version=0.3,
        moe=_MOE_0_19,
    ),
    "0.19.8": SavedFiles(
        zero_per_rank_padding=True,
        param_alignment_paddings=True,
        parallel_dimensions=True,
        sparse_tensor_module_names=False,
        universal_checkpoint_version=0.4,
        recovery_scripts=("zero_to_fp32.py", "zero_to_torch.py"),
    ),
}


def saved_files(version: str) -> SavedFiles:
    """How release ``version`` lays out its files; only the tested releases (a guess would be a lie)."""
    facts = SAVED_FILES.get(version)
    if facts is None:
        raise UnsupportedError(
            f"DeepSpeed {version}: no record of how it writes checkpoints; known releases {', '.join(SAVED_FILES)}",
            subject=version,
        )
    return facts


# Range of ds_version values recorded in checkpoint files that the reader understands.
FILES_MIN_DEEPSPEED = Version("0.10.0")
FILES_MAX_DEEPSPEED = Version("0.19.8")

# BF16_Optimizer records group_paddings on the last rank only, in every version up to this one.
BF16_LAST_RANK_PADDING_UNTIL = Version("0.19.8")
# DeepSpeedZeroOptimizer records per-rank (clamped) group_paddings from this version on.
ZERO_PER_RANK_PADDING_SINCE = Version("0.16.4")
# Stock ds_to_universal's ZeRO-3 path reads every optimizer sub-group from this version on; before, it
# walks every parameter through sub-group 0's partition (``state[0]``, ``fp32_flat_groups[0]``), and its
# stage-3 universal loader fills sub-group 0 only.
STAGE3_STOCK_READS_SUB_GROUPS_SINCE = Version("0.18.0")
# ... and takes ``max(0, min(S, n - r S))`` elements of a rank's slice from this version on; before,
# ``min(S, |n - r S|)``: a padding-only slice comes out as data.
STAGE3_STOCK_STRIPS_PADDING_SINCE = Version("0.19.3")


def stage3_stock_behaviour(version: str) -> tuple[bool, bool]:
    """(reads every sub-group, strips padding-only slices) of stock's stage-3 converter at ``version``."""
    v = Version(Version(version).base_version)
    return v >= STAGE3_STOCK_READS_SUB_GROUPS_SINCE, v >= STAGE3_STOCK_STRIPS_PADDING_SINCE


def installed_deepspeed_version() -> str:
    import deepspeed

    return str(deepspeed.__version__)


def internals(version: str | None = None) -> Internals:
    """What the installed (or given) DeepSpeed's internals look like; untested versions (only
    reachable with ``allow_untested``) get the nearest tested release at or below them."""
    found = Version(Version(version or installed_deepspeed_version()).base_version)
    known = sorted((Version(v), v) for v in INTERNALS)
    below = [name for parsed, name in known if parsed <= found]
    return INTERNALS[below[-1] if below else known[0][1]]


def check_hooks_supported(allow_untested: bool = False) -> str:
    """Return the installed DeepSpeed version, or raise if the hooks were not written for it."""
    found = installed_deepspeed_version()
    base = Version(found).base_version
    if base in HOOKS_TESTED_DEEPSPEED:
        return found
    message = (
        f"megatron-ucp hooks were written and tested for DeepSpeed {', '.join(HOOKS_TESTED_DEEPSPEED)}, "
        f"but DeepSpeed {found} is installed. Its internals may differ; refusing to patch them. "
        "Install a supported DeepSpeed, apply the diffs in patches/ instead, or pass "
        "allow_untested_deepspeed=True (MEGATRON_UCP_ALLOW_UNTESTED_DEEPSPEED=1) at your own risk."
    )
    if not allow_untested:
        raise UnsupportedError(message, subject=found)
    log.warning("UNTESTED DEEPSPEED: %s", message)
    return found


def check_file_version(ds_version: str, path: str) -> Version:
    """Parse a checkpoint file's recorded ds_version and refuse ones outside the known range."""
    try:
        parsed = Version(str(ds_version))
    except Exception as exc:  # packaging raises InvalidVersion
        raise UnsupportedError(f"{path}: unreadable ds_version {ds_version!r}", subject=path) from exc
    base = Version(parsed.base_version)
    if not (FILES_MIN_DEEPSPEED <= base <= FILES_MAX_DEEPSPEED):
        raise UnsupportedError(
            f"{path}: written by DeepSpeed {ds_version}, outside the versions this converter knows "
            f"({FILES_MIN_DEEPSPEED} .. {FILES_MAX_DEEPSPEED}); refusing rather than guessing its layout.",
            subject=path,
        )
    return parsed
