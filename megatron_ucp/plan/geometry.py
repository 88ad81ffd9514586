"""ZeRO-1/2 partition geometry, and what stock DeepSpeed does with it. Pure: no I/O, no torch.

For a param group whose parameters hold ``numel`` elements in flat order (``padded_numel`` once
per-parameter alignment padding is added), DeepSpeed pads the flat buffer to a multiple of
``alignment = 2 * dp`` and gives each of the ``dp`` ranks an equal slice of ``partition_size``
elements. Rank ``r``'s true (unpadded) length is ``clamp(padded_numel - r * S, 0, S)``; a rank
whose true length is 0 holds only padding. This module answers, from numbers alone, which ranks
those are and whether stock DeepSpeed's converter or universal loader would crash -- which is
what ``megatron-ucp inspect`` reports for a DP=768 AuroraGPT-7B checkpoint without reading a tensor.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

from megatron_ucp.errors import UcpError

NCCL_START_ALIGNMENT_FACTOR = 2
"""DeepSpeed aligns flat buffers to 2 elements per rank (4 bytes of bf16/fp16)."""


class PaddingStyle(enum.Enum):
    """How a DeepSpeed version records ``group_paddings`` in each rank's optimizer file."""

    LAST_RANK_ONLY = "last-rank-only"
    """``P - N`` on the last rank, 0 elsewhere: BF16_Optimizer (all versions), ZeRO before 0.16.4."""
    PER_RANK = "per-rank"
    """``S - t_r`` on every rank: ZeRO from 0.16.4, and anything saved with megatron-ucp installed."""


@dataclass(frozen=True)
class GroupGeometry:
    """Partition geometry of one param group at one DP size."""

    numel: int
    dp: int
    padded_numel: int = -1
    alignment_factor: int = NCCL_START_ALIGNMENT_FACTOR

    def __post_init__(self) -> None:
        if self.padded_numel == -1:
            object.__setattr__(self, "padded_numel", self.numel)
        if self.dp < 1:
            raise UcpError(f"DP size must be >= 1, got {self.dp}")
        if self.numel < 0 or self.padded_numel < self.numel:
            raise UcpError(f"invalid group size: numel={self.numel}, padded_numel={self.padded_numel}")

    @property
    def alignment(self) -> int:
        return self.alignment_factor * self.dp

    @property
    def padded_total(self) -> int:
        """P: the flat buffer's length after DP alignment."""
        a = self.alignment
        return -(-self.padded_numel // a) * a

    @property
    def partition_size(self) -> int:
        """S: elements per rank."""
        return self.padded_total // self.dp

    @property
    def total_padding(self) -> int:
        """Alignment padding at the end of the flat buffer (P - N')."""
        return self.padded_total - self.padded_numel

    def partition_start(self, rank: int) -> int:
        return rank * self.partition_size

    def true_length(self, rank: int) -> int:
        """Elements of rank ``rank``'s partition that precede the end-of-buffer padding."""
        self._check_rank(rank)
        s = self.partition_size
        return max(0, min(s, self.padded_numel - rank * s))

    def true_lengths(self) -> list[int]:
        return [self.true_length(r) for r in range(self.dp)]

    def padding(self, rank: int) -> int:
        """The correct per-rank ``group_paddings`` value."""
        return self.partition_size - self.true_length(rank)

    def padding_only_ranks(self) -> list[int]:
        """Ranks whose partition of this group holds no real element."""
        return [r for r in range(self.dp) if self.true_length(r) == 0]

    def recorded_padding(self, rank: int, style: PaddingStyle) -> int:
        """What a DeepSpeed version writes as ``group_paddings`` for ``rank``."""
        self._check_rank(rank)
        if style is PaddingStyle.PER_RANK:
            return self.padding(rank)
        return self.total_padding if rank == self.dp - 1 else 0

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.dp:
            raise UcpError(f"rank {rank} out of range for DP size {self.dp}")


@dataclass(frozen=True)
class StripCrash:
    """Stock ``_strip_tensor_paddings`` would narrow a state of ``state_numel`` by ``padding``."""

    group: int
    rank: int
    padding: int
    state_numel: int

    @property
    def raw_length(self) -> int:
        return self.state_numel - self.padding


def stock_converter_crashes(groups: Sequence[GroupGeometry], style: PaddingStyle) -> list[StripCrash]:
    """Where ``ds_to_universal`` dies with ``narrow(): length must be non-negative``.

    The converter strips ``group_paddings[g]`` from each rank's (full-partition) optimizer state
    tensors; a recorded padding larger than the partition gives a negative length.
    """
    crashes = []
    for g, geo in enumerate(groups):
        for r in range(geo.dp):
            pad = geo.recorded_padding(r, style)
            if pad > geo.partition_size:
                crashes.append(StripCrash(group=g, rank=r, padding=pad, state_numel=geo.partition_size))
    return crashes


def at_dp(groups: Sequence[GroupGeometry], dp: int) -> list[GroupGeometry]:
    """The same groups re-partitioned for another DP size (per-parameter padding is DP-independent)."""
    return [
        GroupGeometry(numel=g.numel, dp=dp, padded_numel=g.padded_numel, alignment_factor=g.alignment_factor)
        for g in groups
    ]


def stock_loader_crash_ranks(groups: Sequence[GroupGeometry], target_dp: int) -> dict[int, list[int]]:
    """Ranks at ``target_dp`` on which stock ``load_universal`` dies with IndexError, per group.

    ``load_hp_checkpoint_state_from_checkpoint_dir`` indexes ``steps[0]`` after collecting one
    step per parameter fragment the rank owns; a rank owning no fragment of a group has none.
    """
    out = {}
    for g, geo in enumerate(at_dp(groups, target_dp)):
        ranks = geo.padding_only_ranks()
        if ranks:
            out[g] = ranks
    return out


def parse_dp_range(text: str) -> list[int]:
    """Parse ``"1-1024"``, ``"512,768,1024"`` or ``"8-64:8"`` (start-stop:step) into DP sizes."""
    sizes: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            step = 1
            if ":" in part:
                part, step_text = part.split(":", 1)
                step = int(step_text)
            if "-" in part:
                lo_text, hi_text = part.split("-", 1)
                lo, hi = int(lo_text), int(hi_text)
            else:
                lo = hi = int(part)
            if lo < 1 or hi < lo or step < 1:
                raise ValueError(part)
            sizes.update(range(lo, hi + 1, step))
    except ValueError as exc:
        raise UcpError(f"invalid DP range {text!r}: use e.g. 1-1024, 512,768 or 8-64:8") from exc
    if not sizes:
        raise UcpError(f"empty DP range {text!r}")
    return sorted(sizes)
