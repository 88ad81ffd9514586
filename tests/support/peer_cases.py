"""What DeepSpeed's own checkpoint tests do that a training script rarely does, in one small DeepSpeed job per case
(CPU, gloo, two ranks under torchrun; the hooks installed as a user's script installs them):
``python -m torch.distributed.run --nproc-per-node 2 -m tests.support.peer_cases CASE ROOT``.

* ``save-load``: an asynchronous save whose files the script then reads itself after ``megatron_ucp.wait_for_saves()``
  (prints ``READ <tag> <entries>``); then another, and at once a load of it in the same process (an evaluation, a
  rollback): the load commits the save first and loads it (prints ``LOADED <tag> <step>``).
* ``exit-without-handlers``: an asynchronous save, then the process group left and the process ended with
  ``os._exit`` (a pool's worker: no exit handlers): the save is committed when the group is left.
* ``elastic``: ZeRO-2 with ``elastic_checkpoint`` saved and loaded (DeepSpeed's own form): as stock DeepSpeed does,
  with one warning (prints ``LOADED``), and a save in that form loaded by a job without it (stock's load).
"""

from __future__ import annotations

import os
import sys

import torch


def _engine(elastic: bool, seed: int = 0):
    import deepspeed

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    config = {
        "train_batch_size": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2, "elastic_checkpoint": elastic},
        "bf16": {"enabled": True},
        "steps_per_print": 1000000,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _train(engine, steps: int) -> None:
    for step in range(steps):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(step + 10 * engine.global_rank))
        loss = engine(x.to(torch.bfloat16)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()


def main(case: str, root: str) -> None:
    import deepspeed

    import megatron_ucp

    megatron_ucp.install(async_save=case != "elastic")
    deepspeed.init_distributed("gloo")
    rank = int(os.environ["RANK"])
    if case == "save-load":
        engine = _engine(False)
        _train(engine, 1)
        engine.save_checkpoint(root)
        megatron_ucp.wait_for_saves()
        model_file = os.path.join(root, "global_step1", "mp_rank_00_model_states.pt")
        read = torch.load(model_file, map_location="cpu", weights_only=False)
        if rank == 0:
            print(f"READ global_step1 {len(read['module'])}", flush=True)
        _train(engine, 1)
        engine.save_checkpoint(root)
        fresh = _engine(False, seed=1)
        path, _ = fresh.load_checkpoint(root)
        same = all(
            torch.equal(a, b) for a, b in zip(engine.module.parameters(), fresh.module.parameters(), strict=True)
        )
        if rank == 0:
            print(f"LOADED {os.path.basename(os.path.dirname(path))} {fresh.global_steps} same={same}", flush=True)
    elif case == "exit-without-handlers":
        engine = _engine(False)
        _train(engine, 2)
        engine.save_checkpoint(root)
        deepspeed.comm.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)
    elif case == "elastic":
        engine = _engine(True)
        _train(engine, 2)
        engine.save_checkpoint(root)
        for elastic in (True, False):
            fresh = _engine(elastic, seed=1)
            path, _ = fresh.load_checkpoint(root)
            if rank == 0:
                print(f"LOADED elastic={elastic} {fresh.global_steps}", flush=True)
    else:
        raise SystemExit(f"unknown case {case!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
