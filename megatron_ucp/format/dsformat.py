"""Names of DeepSpeed's checkpoint files and keys, and the keys megatron-ucp adds.

Kept in one place so that the reader, the writer, the hooks and the upstream patches in
patches/ agree on spelling. DeepSpeed's own names are restated (not imported) so that reading a
checkpoint does not depend on the installed DeepSpeed's constants module.
"""

from __future__ import annotations

import re

# ---- DeepSpeed file names -------------------------------------------------------------------
LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron's own pointer to the newest save: the iteration, beside ``latest``."""
MODEL_STATES_FILE = "mp_rank_00_model_states.pt"
OPTIM_FILE_RE = re.compile(r"^(?P<prefix>bf16_|fp16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
MODEL_FILE_RE = re.compile(r"^mp_rank_(?P<mp>\d+)(?:_(?P<pp>\d+))?_model_states\.pt$")
LAYER_FILE_RE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
ZERO3_MODEL_FILE_RE = re.compile(r"^zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
"""ZeRO-3's per-rank model states (the module's partitioned, empty tensors, its shapes and client state)."""
UNIVERSAL_SUFFIX = "_universal"
UCP_DIR = ".ucp"
"""Beside the tags (``<save_dir>/.ucp/``): megatron-ucp's store (queue, verdicts, the saves' file lists, ...)."""
UNIVERSAL_ZERO_DIR = "zero"
UNIVERSAL_OPTIMIZER_STATE_FILE = "optimizer_state.pt"

# ---- DeepSpeed keys ---------------------------------------------------------------------------
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"
FP32_FLAT_GROUPS = "fp32_flat_groups"
"""ZeRO-3: each sub-group's fp32 partition on this rank (its parameters' slices, one after the other)."""
GROUP_PADDINGS = "group_paddings"
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"
PARTITION_COUNT = "partition_count"
ZERO_STAGE = "zero_stage"
DS_VERSION = "ds_version"
DS_CONFIG = "ds_config"
MODULE = "module"
"""The model-states key holding the module weights (bf16 at our users' settings: most of the file)."""
PARAM_GROUPS = "param_groups"
PARAM_SHAPES = "param_shapes"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
UNIVERSAL_CHECKPOINT_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_CHECKPOINT_VERSION_VALUE = 0.2
VOCABULARY_PARAMETER_PATTERNS = "vocabulary_parameter_patterns"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
PARAMETER_WITH_ROW_PARALLELISM_PATTERNS = "parameter_with_row_parallelism_patterns"
PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0 = "parameter_with_2_sub_params_cat_dim_0"
TP_REPLICATED_PARAMETER_PATTERNS = "tp_replicated_parameter_patterns"
PIPELINE_REPLICATED_PARAMETER_PATTERNS = "pipeline_replicated_parameter_patterns"
CHECKPOINT_PARALLEL_DIMENSIONS = "checkpoint_parallel_dimensions"
PARAM = "param"
CAT_DIM = "cat_dim"
VOCAB_TENSOR = "vocab_tensor"
PARAM_N_SUB_PARAMS = "param_n_sub_params"
FP32_STATE = "fp32"
STEP_STATE = "step"
DP_WORLD_SIZE = "dp_world_size"
MP_WORLD_SIZE = "mp_world_size"

# Keys of the optimizer state dict that are per-rank shards (not copied to optimizer_state.pt).
SHARDED_OPTIMIZER_KEYS = (BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS)

# ---- keys megatron-ucp adds at save time (hooks and patches/ write the same but the checksums) ----
GROUP_TRUE_LENGTHS = "group_true_lengths"
"""Per param group: this rank's true (unpadded) number of elements in its partition."""
ZERO_PARTITION_INFO = "zero_partition_info"
"""Dict: version, dp_size, dp_rank, alignment, group_numels, padded_group_numels, partition_sizes. ZeRO-3:
version, zero_stage (3), dp_size, dp_rank, sub_group_numels (per sub-group, each parameter's numel),
sub_group_param_groups (the param group of each sub-group), partition_sizes (per sub-group)."""
PARAM_TRUE_LENGTHS = "param_true_lengths"
"""ZeRO-3: per sub-group, this rank's true (unpadded) length of each parameter's slice."""
ZERO_PARTITION_INFO_VERSION = 1
ZERO_PARTITION_CHECKSUMS = "zero_partition_checksums"
"""megatron-ucp's save record: ``{"algorithm": ..., "groups": [{state: [numel, checksum]}, ...]}``, the
checksum (``format.integrity``) of this rank's real elements of the fp32 partition and of every
optimizer state, at their flat positions in the group, computed on the partitions in memory. ZeRO-3: per
sub-group, each parameter's real run hashed at its position in its param group (its parameters end to end,
unpadded: the same at every DP size), the runs combined."""

UCP_SAVE_RECORD = "ucp_save_record"
"""megatron-ucp's identity of one save, written by the hooks (not by the diffs in patches/): in every
rank's optimizer state dict ``{"version", "save_id", "dp_size", "dp_rank"}`` and, as client state, in
every model-states file ``{"version", "save_id"}``. One ``save_id`` (random, agreed by every rank at
the start of ``save_checkpoint``) binds the files of one save together: a file of another run or of
another step, even of the same geometry, carries another."""
UCP_SAVE_RECORD_VERSION = 1

UCP_PARTITION_SCALARS = "ucp_partition_scalars"
"""In a universal folder's ``zero/optimizer_state.pt``: per param group, ``{state: value}`` of the optimizer's
states of one value per partition besides ``step`` (NAdam's ``mu_product``), the same in every rank file of the
save. A universal state file is one parameter's elements; these have none. Stock DeepSpeed's loader ignores the
key (and leaves such states as a first step makes them)."""

VOCAB_ROWS_WHOLE = "ucp_vocab_rows_whole"
"""In a ZeRO-3 conversion's vocabulary state file: ``param`` holds every row, the padded ones included (stock's
stage-3 loader partitions the tensor it finds as the live parameter, so it is not trimmed); megatron-ucp's loader
keeps the rows both padded sizes have when the padded size changes (a TP change)."""
VOCAB_PADDED_ROWS = "ucp_padded_vocab_rows"
"""In a vocabulary parameter's state file, beside the ``param`` DeepSpeed trims to
``original_vocab_size``: the trimmed (padded) rows, so that a universal round trip loses nothing.
The padded rows' logits enter the softmax of every step, so their weights and optimizer states
matter. Stock DeepSpeed's loader ignores the key (and zero-fills those rows, as before)."""

# ---- megatron-ucp universal-folder bookkeeping -----------------------------------------------
MANIFEST_FILE = "ucp_manifest.json"
"""Written last inside a finished universal folder; its presence after the rename is the commit."""
MANIFEST_FORMAT = "megatron-ucp/universal"
MANIFEST_VERSION = 1
STAGING_SUFFIX = ".ucp-staging"
"""Temporary sibling: <parent>/.<output name>.ucp-staging, renamed into place when complete."""


def zero3_model_file(dp_rank: int, mp_rank: int) -> str:
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"


def mp_rank_of(name: str) -> int:
    """The model-parallel rank in a DeepSpeed file's name (an optimizer file, a model-states file of either kind);
    0 for any other name, as a job without model parallelism names its files."""
    for pattern in (OPTIM_FILE_RE, MODEL_FILE_RE, ZERO3_MODEL_FILE_RE):
        found = pattern.match(name)
        if found is not None:
            return int(found["mp"])
    return 0


def universal_tag(tag: str) -> str:
    """The universal twin's tag for a native tag: global_step100 -> global_step100_universal."""
    return tag if tag.endswith(UNIVERSAL_SUFFIX) else tag + UNIVERSAL_SUFFIX


def staging_name(output_name: str) -> str:
    return f".{output_name}{STAGING_SUFFIX}"
