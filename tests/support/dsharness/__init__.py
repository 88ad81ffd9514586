"""Real multi-process DeepSpeed runs (CPU, gloo) for the tests: no mocks.

::

    from tests.support.dsharness import TrainSpec, TrainResult, run_training, tiny_model_param_groups

    res = run_training(TrainSpec(dp=4, optimizer="bf16", steps=4, save_dir=root, save_at=(2, 4),
                                 dump_dir=dumps))
    res.losses, res.steps, res.optimizer_class, res.dumps["state_step4"]

``run_training`` runs ``spec.dp`` ranks of ``tests.support.dsharness.worker`` from the repository root (gloo
rendezvous on a free local port, ``DS_ACCELERATOR=cpu``, ``OMP_NUM_THREADS=1``): on the CPU forked from a process
that imported torch and DeepSpeed once for the session (``tests/support/preload``; ``UCP_PRELOAD=0`` starts each rank
as its own ``python -m tests.support.dsharness.worker <spec-json>``, as a CUDA run always does). It kills every rank
when one dies or on timeout, and raises ``RuntimeError`` with the log tail on a non-zero exit unless
``spec.expect_failure``.

Dumps (when ``spec.dump_dir`` is set), written right after a load (suffix ``_loaded``) and after
every save; ``N`` is ``engine.global_steps``:

* ``state_step{N}.pt`` (rank 0): ``{param name: {"fp32": full fp32 master, "<state>": full tensor
  for every optimizer state shaped like the partitions (``exp_avg``, ``exp_avg_sq``), "step": the
  raw ``state["step"]`` of the param's group}}``, gathered with ``safe_get_full_fp32_param`` /
  ``safe_get_full_optimizer_state``;
* ``rank{r}_step{N}.pt`` (every rank): ``{"fp32": [flat fp32 partition per group],
  "optim_state": [{state name: raw value} per group], "param_groups": [hyperparameters per group],
  "param_names": [[names] per group, flat order], "lr_scheduler", "global_steps",
  "global_samples", "skipped_steps", "rank", "dp", "global_step", "optimizer_class",
  "ds_version"}``.

``res.dumps`` maps the stem of every ``*.pt`` in ``dump_dir`` to its path (use a fresh folder per run).

Model and data: :mod:`tests.support.dsharness.model` (group 0 = weight decay, group 1 = the norm weights).
Session-cached checkpoints, the 0.16.2 fixtures and the geometry oracle:
:mod:`tests.support.dsharness.checkpoints` (fixtures ``ds_checkpoint`` / ``legacy_fixture`` in
``tests/conftest.py``). Stock ``ds_to_universal``: :func:`tests.support.dsharness.stock.stock_ds_to_universal`.
"""

from __future__ import annotations

from .launch import REPO_ROOT, free_port, run_training
from .model import (
    build_model,
    global_batch_tokens,
    original_vocab_size,
    param_group_names,
    rank_batch,
    tiny_model_param_groups,
)
from .spec import TrainResult, TrainSpec

__all__ = [
    "TrainSpec",
    "TrainResult",
    "run_training",
    "tiny_model_param_groups",
    "param_group_names",
    "build_model",
    "global_batch_tokens",
    "rank_batch",
    "original_vocab_size",
    "free_port",
    "REPO_ROOT",
]
