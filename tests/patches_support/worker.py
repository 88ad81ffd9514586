"""One data-parallel rank of a tiny DeepSpeed ZeRO-1 bf16 run, for tests/test_patches.py.

Run as a plain script (``python tests/patches_support/worker.py --spec spec.json``) with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, so that whatever ``deepspeed`` comes first on
PYTHONPATH is the one imported (the patched copy or the installed package). It never imports
megatron_ucp: these runs exercise DeepSpeed alone.

The model has Megatron-style parameter names. Its no-weight-decay group holds 3 norm weights of
size 3 (N = 9): at DP=4 the alignment is 8, the padded group 16, a partition 4, so rank 2 holds one
real element and rank 3 none.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

VOCAB = 16
HIDDEN = 3
FFN = 8
SEQ = 8
MICRO_BATCH = 2


class TinyGPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1234)
        self.embedding = torch.nn.Module()
        self.embedding.word_embeddings = torch.nn.Embedding(VOCAB, HIDDEN)
        self.decoder = torch.nn.Module()
        layer = torch.nn.Module()
        layer.input_layernorm = _Norm()
        layer.mlp = torch.nn.Module()
        layer.mlp.linear_fc1 = torch.nn.Linear(HIDDEN, FFN, bias=False)
        layer.mlp.linear_fc2 = torch.nn.Linear(FFN, HIDDEN, bias=False)
        layer.pre_mlp_layernorm = _Norm()
        self.decoder.layers = torch.nn.ModuleList([layer])
        self.decoder.final_layernorm = _Norm()
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "layernorm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(0.5 * torch.randn(p.shape, generator=g))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        layer = self.decoder.layers[0]
        h = self.embedding.word_embeddings(tokens)
        h = h + layer.mlp.linear_fc2(torch.nn.functional.gelu(layer.mlp.linear_fc1(layer.input_layernorm(h))))
        h = layer.pre_mlp_layernorm(h)
        h = self.decoder.final_layernorm(h)
        logits = h.float() @ self.embedding.word_embeddings.weight.float().t()
        return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


class _Norm(torch.nn.Module):
    """RMSNorm-like: a weight of size HIDDEN (goes to the no-weight-decay group)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
        return (y * self.weight.float()).to(x.dtype)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def ds_config(spec: dict) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.1, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }
    if spec.get("optimizer") == "bf16":  # BF16_Optimizer: bf16 + ZeRO-1 + fp32 gradient accumulation
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if spec.get("load_universal"):
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    spec = json.load(open(parser.parse_args().spec))
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    import deepspeed  # the first on PYTHONPATH: a patched copy or the installed package

    if spec.get("hooks"):
        import megatron_ucp

        megatron_ucp.install()

    deepspeed.init_distributed(dist_backend="gloo")
    model = TinyGPT()
    decay = [p for n, p in model.named_parameters() if "layernorm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "layernorm" in n]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config(spec))

    report: dict = {"rank": rank, "deepspeed_file": deepspeed.__file__, "optimizer": type(optimizer).__name__,
                    "losses": {}}
    start = 0
    if spec.get("load_dir"):
        path, client = engine.load_checkpoint(spec["load_dir"], tag=spec.get("load_tag"))
        assert path is not None, f"nothing loaded from {spec['load_dir']}"
        start = int(client["iteration"])
        report["loaded_from"] = path
        report["loaded_state"] = _optimizer_state_summary(optimizer)

    for step in range(start + 1, spec["steps"] + 1):
        tokens, labels = batch(step, rank)
        loss = engine(tokens, labels)
        engine.backward(loss)
        engine.step()
        report["losses"][step] = float(loss.detach().float())
        if step in spec.get("save_at", []):
            engine.save_checkpoint(spec["save_dir"], tag=f"global_step{step}", client_state={"iteration": step})

    report["final_state"] = _optimizer_state_summary(optimizer)
    with open(os.path.join(spec["report_dir"], f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    deepspeed.comm.barrier()


def _optimizer_state_summary(optimizer) -> list:
    """Per param group of the wrapped torch optimizer: its state keys, step and flat numel."""
    out = []
    for group in optimizer.optimizer.param_groups:
        hp = group["params"][0]
        state = optimizer.optimizer.state.get(hp, {})
        step = state.get("step")
        out.append({
            "keys": sorted(state.keys()),
            "step": None if step is None else float(step),
            "numel": hp.numel(),
            "shapes": {k: list(v.shape) for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0},
        })
    return out


if __name__ == "__main__":
    main()
