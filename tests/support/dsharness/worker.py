"""One rank of a harness run: ``python -m tests.support.dsharness.worker <spec-json>``.

Launched by :func:`tests.support.dsharness.run_training` with the torch.distributed environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``) and
``DS_ACCELERATOR=cpu``. Call order: optional ``megatron_ucp.install`` -> gloo process group ->
model/AdamW -> ``deepspeed.initialize`` -> optional ``load_checkpoint`` (+ dump) -> train, saving
(+ dump) after every step in ``save_at``.

Rank 0 reports to the launcher through single stdout lines ``UCP_HARNESS <json>`` (kind ``info``,
``step`` or ``done``), so that a run that dies half-way still yields the losses it produced.
Written against the public DeepSpeed API only, so it runs under DeepSpeed 0.16.2 as well as 0.19.8.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from .spec import MARKER, TrainSpec

LR_MAX = 1e-2
LR_MIN = 1e-3
WARMUP_STEPS = 8
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
GRADIENT_CLIPPING = 1.0


def _report(kind: str, **payload: Any) -> None:
    print(MARKER + json.dumps({"kind": kind, **payload}), flush=True)


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def ds_config(spec) -> dict:
    """The DeepSpeed config of a spec (also used by tests that want to see it)."""
    config: dict[str, Any] = {
        "train_batch_size": spec.global_batch,
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": GRADIENT_CLIPPING,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": spec.zero_stage},
        "zero_allow_untested_optimizer": True,
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": LR_MIN,
                "warmup_max_lr": LR_MAX,
                "warmup_num_steps": WARMUP_STEPS,
                "warmup_type": "linear",
            },
        },
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }
    if spec.optimizer == "bf16":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if spec.load_universal:
        config["checkpoint"] = {"load_universal": True}
    return _deep_merge(config, spec.extra_config)


def universal_checkpoint_info(spec) -> dict:
    """What Megatron-DeepSpeed puts in the client state (TP=PP=1 subset).

    Only the word embedding is a vocabulary parameter: its padded rows are never looked up, so
    trimming them (as universal conversion does) cannot change the loss of a resumed run.
    """
    from deepspeed.checkpoint import constants as c

    from .model import original_vocab_size

    return {
        c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        # ds_to_universal applies these with re.match (anchored at the start of the name).
        c.VOCABULARY_PARAMETER_PATTERNS: [r"language_model\.embedding\.word_embeddings\.weight"],
        c.ORIGINAL_VOCAB_SIZE: original_vocab_size(spec.vocab),
        c.PARAMETER_TO_AVERAGE_PATTERNS: [],
        c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [],
    }


class Rank:
    def __init__(self, spec) -> None:
        self.spec = spec
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        if self.world != spec.dp:
            raise RuntimeError(f"WORLD_SIZE {self.world} != spec.dp {spec.dp}")
        self.t0 = time.perf_counter()
        self.times: dict[str, float] = {}

    def mark(self, what: str) -> None:
        self.times[what] = round(time.perf_counter() - self.t0, 3)

    # --- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        import torch

        torch.set_num_threads(1)
        spec = self.spec
        if spec.plugin:
            import megatron_ucp

            megatron_ucp.install(**spec.plugin_kwargs)
        import deepspeed
        import torch.distributed as dist  # the harness's own collectives (DeepSpeed's comm API varies)

        from .model import build_model, param_group_names, tiny_model_param_groups

        self.torch, self.deepspeed, self.dist = torch, deepspeed, dist
        import torch._dynamo  # noqa: F401  (torch.optim imports it lazily; pay for it here)

        # DeepSpeed's see_memory_usage() calls gc.collect() several times during initialize; with
        # the imported modules moved out of the collected generations that is ~0.05 s, not ~0.5 s.
        gc.freeze()
        self.mark("import")
        self.devices = _record_devices()
        _skip_shm_comm_kernel(deepspeed)
        self.dev = _device(torch)
        deepspeed.init_distributed(dist_backend="gloo" if self.dev.type == "cpu" else "nccl")
        self.mark("init_distributed")
        model = build_model(vocab=spec.vocab, hidden=spec.hidden, num_layers=spec.num_layers, seed=spec.seed)
        self.group_names = param_group_names(model)
        groups = tiny_model_param_groups(model, WEIGHT_DECAY)
        if spec.base_optimizer == "nadam":
            optimizer = torch.optim.NAdam(groups, lr=LR_MAX, betas=BETAS, eps=1e-8, decoupled_weight_decay=True)
        else:
            optimizer = torch.optim.AdamW(groups, lr=LR_MAX, betas=BETAS, eps=1e-8)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(spec))
        self.mark("initialize")
        self.optimizer_class = type(self.engine.optimizer).__name__
        if self.rank == 0:
            _report(
                "info",
                optimizer_class=self.optimizer_class,
                ds_version=deepspeed.__version__,
                torch_version=torch.__version__,
                dp=self.world,
                base_optimizer_class=type(self.engine.optimizer.optimizer).__name__,
                group_names=self.group_names,
            )

    # --- dumps ------------------------------------------------------------------------------------
    def _base(self):
        return self.engine.optimizer.optimizer

    def _state_keys(self) -> list[str]:
        """Optimizer states shaped like the flat partitions (exp_avg, ...), the same on every rank."""
        base = self._base()
        keys: set[str] = set()
        for group in base.param_groups:
            for p in group["params"]:
                for key, value in base.state.get(p, {}).items():
                    if self.torch.is_tensor(value) and value.shape == p.shape:
                        keys.add(key)
        gathered: list[Any] = [None] * self.world
        self.dist.all_gather_object(gathered, sorted(keys))
        if any(g != gathered[0] for g in gathered):
            raise RuntimeError(f"optimizer state keys differ between ranks: {gathered}")
        return gathered[0]

    def _gather(self, param, flat):
        """The full fp32 tensor of ``param`` from every rank's flat partition ``flat`` (sum of zeros
        and the owned fragments: exact). Uses the fragment addresses DeepSpeed attaches to each
        bf16 parameter (``param._hp_mapping``), i.e. DeepSpeed's own map of who owns what."""
        torch = self.torch
        buf = torch.zeros(param.numel(), dtype=torch.float32, device=self.dev)  # where the backend reduces
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is not None:
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            buf.narrow(0, lp.start, lp.numel).copy_(flat.detach().reshape(-1).narrow(0, hp.start, hp.numel).float())
        self.dist.all_reduce(buf)
        return buf.cpu().view(param.shape)

    def _all_true(self, flag: bool) -> bool:
        t = self.torch.tensor([1 if flag else 0], dtype=self.torch.int32, device=self.dev)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
        return bool(t.item())

    def dump(self, suffix: str) -> None:
        """Rank 0: full tensors per parameter; every rank: its raw flat partitions per group.

        The full tensors are assembled from the flat fp32 partition and the flat optimizer states
        the base optimizer will actually use next step (``base.state[flat partition]``), and
        cross-checked against ``deepspeed.utils.safe_get_full_fp32_param`` /
        ``safe_get_full_optimizer_state`` (reported in the info line as ``safe_get``). The latter
        cannot be the source: DeepSpeedZeroOptimizer links the optimizer-state views after the
        first group's ``step()``, so groups >= 1 have none ("exp_avg not found in optimizer state
        fragment"), and calling it on only some ranks would deadlock the collective.
        """
        spec = self.spec
        if spec.dump_dir is None:
            return
        if spec.zero_stage == 3:
            self.dump_stage3(suffix)
            return
        torch = self.torch
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        step = self.engine.global_steps
        keys = self._state_keys()
        base = self._base()
        group_of = {name: g for g, names in enumerate(self.group_names) for name in names}
        flats = [g["params"][0] for g in base.param_groups]
        group_steps = []
        for flat in flats:
            value = base.state.get(flat, {}).get("step")
            group_steps.append(value.clone() if torch.is_tensor(value) else value)

        full: dict[str, dict[str, Any]] = {}
        safe_get: dict[str, str] = {}
        for name, param in self.engine.module.named_parameters():
            g = group_of[name]
            entry: dict[str, Any] = {"fp32": self._gather(param, flats[g])}
            ds_fp32 = safe_get_full_fp32_param(param)  # None where DeepSpeed linked no _hp_mapping
            if ds_fp32 is None:
                safe_get[f"{name}/fp32"] = "unavailable"
            elif not torch.equal(ds_fp32.float().cpu(), entry["fp32"]):
                safe_get[f"{name}/fp32"] = "DIFFERS"
            for key in keys:
                entry[key] = self._gather(param, base.state[flats[g]][key])
                mapping = getattr(param, "_hp_mapping", None)
                linked = mapping is None or key in (getattr(mapping, "optim_fragment", None) or {})
                if self._all_true(linked):
                    ds_state = safe_get_full_optimizer_state(param, key)
                    if not torch.equal(ds_state.float().cpu(), entry[key]):
                        safe_get[f"{name}/{key}"] = "DIFFERS"
                else:
                    safe_get[f"{name}/{key}"] = "unavailable"
            entry["step"] = group_steps[g]
            full[name] = entry

        def clone(v: Any) -> Any:
            return v.detach().clone().cpu() if torch.is_tensor(v) else v

        scheduler = self.engine.lr_scheduler
        rank_dump = {
            "rank": self.rank,
            "dp": self.world,
            "global_step": step,
            "optimizer_class": self.optimizer_class,
            "ds_version": self.deepspeed.__version__,
            "param_names": self.group_names,
            "fp32": [clone(flat) for flat in flats],
            "optim_state": [{k: clone(v) for k, v in base.state.get(flat, {}).items()} for flat in flats],
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups],
            "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
            "global_steps": self.engine.global_steps,
            "global_samples": self.engine.global_samples,
            "skipped_steps": self.engine.skipped_steps,
            "module": {k: clone(v) for k, v in self.engine.module.state_dict().items()},
        }
        out = Path(spec.dump_dir)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(rank_dump, out / f"rank{self.rank}_step{step}{suffix}.pt")
        if self.rank == 0:
            torch.save(full, out / f"state_step{step}{suffix}.pt")
            summary = {
                verdict: sorted(k for k, v in safe_get.items() if v == verdict)
                for verdict in ("unavailable", "DIFFERS")
            }
            _report(
                "dump",
                name=f"state_step{step}{suffix}",
                state_keys=keys,
                safe_get_unavailable=summary["unavailable"],
                safe_get_differs=summary["DIFFERS"],
            )
        self.dist.barrier()

    def dump_stage3(self, suffix: str) -> None:
        """ZeRO-3: rank 0's full tensors come from DeepSpeed's own gather of the live partitions
        (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``: its bookkeeping, not the
        converter's geometry), with the step of each sub-group; every rank dumps its raw sub-group
        partitions (``fp32_partitioned_groups_flat`` and their optimizer states)."""
        torch = self.torch
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        opt = self.engine.optimizer
        base = self._base()
        flats = list(opt.fp32_partitioned_groups_flat)
        sub_group_of = {id(p): i for i, group in enumerate(opt.fp16_groups) for p in group}
        keys = sorted(k for k, v in base.state.get(flats[0], {}).items() if torch.is_tensor(v) and v.dim() > 0)
        full: dict[str, dict[str, Any]] = {}
        for name, param in self.engine.module.named_parameters():
            entry: dict[str, Any] = {"fp32": safe_get_full_fp32_param(param).float().cpu().clone()}
            for key in keys:
                entry[key] = safe_get_full_optimizer_state(param, key).float().cpu().clone()
            step_value = base.state.get(flats[sub_group_of[id(param)]], {}).get("step")
            entry["step"] = step_value.clone() if torch.is_tensor(step_value) else step_value
            entry["sub_group"] = sub_group_of[id(param)]
            full[name] = entry
        rank_dump = {
            "rank": self.rank,
            "dp": self.world,
            "global_step": self.engine.global_steps,
            "optimizer_class": self.optimizer_class,
            "ds_version": self.deepspeed.__version__,
            "fp32": [f.detach().clone().cpu() for f in flats],
            "optim_state": [
                {k: (v.detach().clone().cpu() if torch.is_tensor(v) else v) for k, v in base.state.get(f, {}).items()}
                for f in flats
            ],
            "sub_groups": [[p.ds_id for p in group] for group in opt.fp16_groups],
            "bf16": [f.detach().clone().cpu() for f in opt.fp16_partitioned_groups_flat],
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups],
            "lr_scheduler": self.engine.lr_scheduler.state_dict() if self.engine.lr_scheduler is not None else None,
            "global_steps": self.engine.global_steps,
            "global_samples": self.engine.global_samples,
        }
        out = Path(self.spec.dump_dir)
        out.mkdir(parents=True, exist_ok=True)
        step = self.engine.global_steps
        torch.save(rank_dump, out / f"rank{self.rank}_step{step}{suffix}.pt")
        if self.rank == 0:
            torch.save(full, out / f"state_step{step}{suffix}.pt")
            _report("dump", name=f"state_step{step}{suffix}", state_keys=keys)
        self.dist.barrier()

    # --- run --------------------------------------------------------------------------------------
    def try_refusals(self) -> None:
        """Each ``spec.refuse`` load, expected to fail alike on every rank before the real load."""
        spec = self.spec
        for attempt in spec.refuse:
            if spec.plugin:
                import megatron_ucp

                megatron_ucp.install(**{**spec.plugin_kwargs, **attempt.get("plugin_kwargs", {})})
            try:
                self.engine.load_checkpoint(str(attempt["dir"]), tag=attempt.get("tag"))
                outcome = None
            except Exception as exc:
                outcome = [type(exc).__name__, str(exc)]
            if outcome is None and attempt.get("digest"):  # a load meant to work: what the module holds
                outcome = ["loaded", module_digest(self.engine.module)]
            gathered: list = [None] * self.world
            self.dist.all_gather_object(gathered, outcome)
            if self.rank == 0:
                _report("refusal", name=attempt["name"], outcomes=gathered)
        if spec.refuse and spec.plugin:
            import megatron_ucp

            megatron_ucp.install(**spec.plugin_kwargs)

    def load(self) -> None:
        spec = self.spec
        self.try_refusals()
        load_dir = Path(spec.load_dir)
        if os.environ.get("UCP_HARNESS_PRIVATE_COPIES") == "1":  # each rank its own copy: exact per-rank reads
            load_dir = load_dir.with_name(f"{load_dir.name}.rank{self.rank}")
        before = _process_io()
        masters_before = [m.data_ptr() for m in _masters(self.engine.optimizer)]
        self.dist.barrier()
        t0 = time.perf_counter()
        path, client_state = self.engine.load_checkpoint(str(load_dir), tag=spec.load_tag)
        own = time.perf_counter() - t0
        self.dist.barrier()
        wall = time.perf_counter() - t0
        if path is None:
            raise RuntimeError(f"load_checkpoint({spec.load_dir}, tag={spec.load_tag}) found no checkpoint")
        self.mark("load")
        after = _process_io()
        report = getattr(self.engine, "megatron_ucp_load_report", None)
        stats = {
            "rank": self.rank,
            "seconds": round(own, 4),
            "wall": round(wall, 4),
            **{k: after[k] - before[k] for k in ("read_bytes", "rchar")},
            "rss_before": before["rss"],
            "maxrss": after["maxrss"],
            "phases": dict(report.seconds) if report is not None else None,
            "placement": _placement_report(self.engine.optimizer, masters_before),
        }
        gathered: list = [None] * self.world
        self.dist.all_gather_object(gathered, stats)
        if self.rank == 0:
            _report(
                "info",
                loaded_step=self.engine.global_steps,
                loaded_path=str(path),
                loaded_client_state_keys=sorted((client_state or {}).keys()),
                load_stats=gathered,
            )
        self.dump("_loaded")

    def train(self) -> None:
        spec, engine = self.spec, self.engine
        from .model import rank_batch

        first = engine.global_steps
        while engine.global_steps < spec.steps:
            index = engine.global_steps  # 0-based data step: the same samples at any DP size
            self.memory_save(first)
            tokens, labels = rank_batch(
                index, self.rank, self.world, spec.global_batch, spec.seq, spec.vocab, spec.seed
            )
            loss = engine(tokens.to(self.dev), labels.to(self.dev))
            engine.backward(loss)
            engine.step()
            if spec.nudge == engine.global_steps:
                with self.torch.no_grad():
                    next(engine.module.parameters()).data.view(-1)[0] += 1.0
            mean = loss.detach().float().clone().reshape(1)
            self.dist.all_reduce(mean)
            mean = float(mean.item()) / self.world
            step = engine.global_steps
            if self.rank == 0:
                _report("step", step=step, loss=mean, lr=[g["lr"] for g in engine.optimizer.param_groups])
            for again in range(spec.save_at.count(step)):  # a step listed twice is saved twice, as Megatron's last
                if again:
                    time.sleep(spec.resave_pause)
                client_state: dict[str, Any] = {"iteration": step}
                if spec.uc_info:
                    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

                    client_state[UNIVERSAL_CHECKPOINT_INFO] = universal_checkpoint_info(spec)
                if not self.save(client_state, step):
                    continue
                self.dump("")
            if spec.crash is not None and spec.crash == (step, self.rank):
                if spec.memory_every and not spec.crash_in_commit:  # its memory save committed first (writer threads)
                    from megatron_ucp.integration.save import memory_save

                    memory_save.wait()
                raise RuntimeError(f"harness: rank {self.rank} dies of an exception after step {step}")
        self.mark("train")

    def memory_save(self, first: int) -> None:
        """At a step's start, as the runner's trigger in Megatron's ``train_step``: a memory save of the steps done,
        every ``memory_every``, never of the run's first state (what it loaded) nor of a step saved durably."""
        spec, engine, step = self.spec, self.engine, self.engine.global_steps
        if not spec.memory_every or step == first or step % spec.memory_every or step in spec.save_at:
            return
        import megatron_ucp

        if megatron_ucp.save_to_memory(
            spec.save_dir, step, lambda into: engine.save_checkpoint(into, client_state={"iteration": step})
        ):
            self.dump("")

    def save(self, client_state: dict, step: int) -> bool:
        """One save (then Megatron's tracker, ``spec.tracker``); False when it failed and failures are tolerated."""
        spec = self.spec
        try:
            self.engine.save_checkpoint(str(spec.save_dir), client_state=client_state)
        except Exception as exc:
            if not spec.tolerate_save_failures or type(exc).__name__ != "SaveFailedError":
                raise
            print(f"harness: the save of step {step} failed, training goes on: {exc}", file=sys.stderr, flush=True)
            if self.rank == 0:
                _report("info", **{f"save_failed_{step}_{time.monotonic_ns()}": str(exc)})
            return False
        if spec.tracker:
            if self.rank == 0:
                with open(_megatron_checkpointing().get_checkpoint_tracker_filename(str(spec.save_dir)), "w") as fh:
                    fh.write(str(step))
            self.dist.barrier()
        return True

    def run(self) -> None:
        if self.spec.tracker:
            _megatron_checkpointing()  # loaded before training, as Megatron's is
        self.setup()
        if self.spec.load_dir is not None:
            self.load()
        self.train()
        self.dist.barrier()
        if self.devices is not None and self.spec.dump_dir is not None:
            self.devices.write(Path(self.spec.dump_dir) / f"devices_rank{self.rank}.json")
        if self.rank == 0:
            _report("done", times=self.times)


def _megatron_checkpointing() -> Any:
    """``megatron.checkpointing`` (registered with its tracker's name alone when no Megatron is loaded)."""
    module = sys.modules.get("megatron.checkpointing")
    if module is None:
        import types

        module = types.ModuleType("megatron.checkpointing")
        module.get_checkpoint_tracker_filename = lambda path: os.path.join(path, "latest_checkpointed_iteration.txt")
        sys.modules["megatron.checkpointing"] = module
    return module


def _device(torch: Any) -> Any:
    """This rank's device: the CPU (gloo), or, with ``DS_ACCELERATOR=cuda``, its local GPU (NCCL)."""
    if os.environ.get("DS_ACCELERATOR", "cpu") == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _masters(optimizer: Any) -> list:
    """The fp32 masters of any ZeRO optimizer class (each keeps them under its own name)."""
    for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition"):
        if hasattr(optimizer, name):
            return list(getattr(optimizer, name))
    return []


def _placement_report(optimizer: Any, masters_before: list[int]) -> dict[str, Any]:
    """Where the fp32 masters and the optimizer states are after a load, and whether the masters are still
    the engine's own tensors (the same storage as before the load: written in place, never moved)."""
    import torch

    masters = _masters(optimizer)
    base = getattr(optimizer, "optimizer", None)
    states = [
        t
        for m in masters
        for t in (base.state.get(m, {}).values() if base is not None else ())
        if torch.is_tensor(t) and t.dim() > 0
    ]
    return {
        "masters": sorted({str(m.device) for m in masters}),
        "states": sorted({str(t.device) for t in states}),
        "masters_kept": [m.data_ptr() for m in masters] == masters_before,
        "states_count": len(states),
    }


def module_digest(module: Any) -> str:
    """sha256 over the module's state dict (names, dtypes and bytes), in its order: the same digest as
    the same tensors read from a model-states file (``tests/system/test_module_read.py``)."""
    import hashlib

    h = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}:{flat.dtype}:{flat.numel()};".encode())
        h.update(flat.view(torch_uint8()).numpy().tobytes())
    return h.hexdigest()


def torch_uint8() -> Any:
    import torch

    return torch.uint8


def _process_io() -> dict[str, int]:
    """This process's I/O counters (bytes from storage, bytes through read calls) and memory (bytes)."""
    import resource

    out = {"read_bytes": 0, "rchar": 0, "rss": 0}
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in out:
                out[key] = int(value)
        out["rss"] = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        pass
    out["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _record_devices() -> Any:
    """With ``UCP_HARNESS_RECORD_DEVICES=1``: the recording accelerator (tests/support/device_recorder.py)."""
    if os.environ.get("UCP_HARNESS_RECORD_DEVICES") != "1":
        return None
    from tests.support import device_recorder

    return device_recorder.install()


def _skip_shm_comm_kernel(deepspeed: Any) -> None:
    """Run DeepSpeed's plain gloo path: do not JIT-build its optional shared-memory all-reduce kernel.

    DeepSpeed's CPU backend compiles ``deepspeed_shm_comm`` with g++ on first use (30 s idle,
    minutes on a loaded machine, once per interpreter), only to speed up CPU collectives. The tests
    are about checkpoint contents, which do not depend on it; ``TrainSpec.env`` can set
    ``UCP_HARNESS_SHM_COMM=1`` to build and use it anyway.
    """
    if os.environ.get("UCP_HARNESS_SHM_COMM") == "1":
        return
    ops = deepspeed.ops.__compatible_ops__  # the probe DeepSpeed consults before building
    ops["deepspeed_shm_comm"] = False


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tests.support.dsharness.worker <spec-json>", file=sys.stderr)
        return 2
    Rank(TrainSpec.from_json(argv[1])).run()
    _tear_down()
    return 0


def _tear_down() -> None:
    """Leave the process group explicitly: gloo threads still alive at interpreter shutdown can
    abort a finished rank with "terminate called without an active exception" (exit -6)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        memory_save = sys.modules.get("megatron_ucp.integration.save.memory_save")
        if memory_save is not None:  # the last memory save's commit (the writer threads') before the group goes
            memory_save.wait()
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


def run_rank(argv: list[str]) -> NoReturn:
    """This process as one rank, to its end: a fresh interpreter's (``python -m``) or one forked by a preload server
    (tests/support/preload). An exception ends it as the interpreter would: ``sys.excepthook``, status 1; then
    :func:`tests.support.preload.rank.exit_as_the_interpreter_would` (past the barrier and the group's teardown every
    rank's work is on disk)."""
    from tests.support.preload.rank import exit_as_the_interpreter_would, status_of

    try:
        code = main(argv)
    except SystemExit as exc:
        code = status_of(exc)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_as_the_interpreter_would(code)


if __name__ == "__main__":
    run_rank(sys.argv)
