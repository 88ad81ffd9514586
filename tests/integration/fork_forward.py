"""The real Megatron-DeepSpeed's own ``GPTModel`` forward on a universal folder's fp32 masters (one CPU process).

Run with the prepared checkout first on ``PYTHONPATH`` (``tests/integration/mds.py``'s ``rank_env``)::

    python fork_forward.py TOKENS_JSON OUT_DIR UNIVERSAL_DIR [UNIVERSAL_DIR ...]

It builds the fork's model at TP = PP = 1 from the run's own saved args (``initialize_megatron``, gloo, one rank;
every folder's model flags must be the first's): ``GPTModel``, or for a pipeline save ``GPTModelPipe`` at PP 1,
whose parameters are named as that save names them (nothing of megatron-ucp's name map between the save and the
oracle). For each folder it fills every parameter from ``zero/<name>/fp32.pt`` (Megatron's padding rows of the
vocabulary zero: no token reaches them and the comparison drops their logits) and writes the fp32 logits of the
tokens to ``OUT_DIR/<i>.pt``: what the exported Hugging Face model must compute.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch


def _flags(saved) -> list[str]:
    """The model's flags, as the run was started with them (the forward depends on nothing else)."""
    flags = [
        "--num-layers", str(saved.num_layers),
        "--hidden-size", str(saved.hidden_size),
        "--num-attention-heads", str(saved.num_attention_heads),
        "--num-key-value-heads", str(saved.num_key_value_heads),
        "--ffn-hidden-size", str(saved.ffn_hidden_size),
        "--seq-length", str(saved.seq_length),
        "--max-position-embeddings", str(saved.max_position_embeddings),
        "--normalization", saved.normalization,
        "--layernorm-epsilon", str(saved.layernorm_epsilon),
        "--rotary-position-embeddings-theta", str(saved.rope_theta),
        "--micro-batch-size", "1",
        "--tokenizer-type", saved.tokenizer_type,
        "--vocab-size", str(saved.vocab_size),
        "--make-vocab-size-divisible-by", str(saved.make_vocab_size_divisible_by),
        "--distributed-backend", "gloo",
        "--use-cpu-initialization",
        "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion",
        "--no-gradient-accumulation-fusion",
        "--no-query-key-layer-scaling",
        "--hidden-dropout", "0",
        "--attention-dropout", "0",
    ]  # fmt: skip
    flags += ["--swiglu"] if saved.swiglu else []
    flags += ["--disable-bias-linear"] if not saved.add_bias_linear else []
    flags += ["--use-rotary-position-embeddings"] if saved.use_rotary_position_embeddings else []
    flags += ["--untie-embeddings-and-output-weights"] if saved.untie_embeddings_and_output_weights else []
    return flags


def _saved_args(universal: Path):
    files = sorted(universal.glob("mp_rank_*_model_states.pt")) or sorted(
        universal.glob("zero_pp_rank_*_model_states.pt")
    )
    return torch.load(files[0], weights_only=False)["args"]


def _pipeline_names(listing: list[str]) -> bool:
    """A pipeline save names its parameters by layer index (``1.word_embeddings.weight``)."""
    return any(name.split(".", 1)[0].isdigit() for name in listing)


def main(tokens_file: Path, out: Path, universals: list[Path]) -> None:
    saved = _saved_args(universals[0])
    for other in universals[1:]:
        if _flags(_saved_args(other)) != _flags(saved):
            raise SystemExit(f"{other}: another model than {universals[0]}'s")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.argv = ["fork_forward", *_flags(saved), "--deepspeed"]  # --deepspeed: GPTModelPipe can be built too
    from megatron.arguments import core_transformer_config_from_args
    from megatron.core.enums import ModelType
    from megatron.global_vars import get_args
    from megatron.initialize import initialize_megatron
    from megatron.model import GPTModel, GPTModelPipe
    from megatron.utils import update_rotary_pos_emb

    initialize_megatron()
    args = get_args()
    args.model_type = ModelType.encoder_or_decoder  # what pretrain() sets for GPT
    config = core_transformer_config_from_args(args)
    models = {}

    def model_for(pipeline: bool):
        """The fork's GPTModel, or for a pipeline save its GPTModelPipe at PP 1 (its parameters named as the save
        names them: no name map of ours between), each built once as the fork's model_provider builds it."""
        if pipeline not in models:
            if pipeline:
                args.attn_mask = (torch.tril(torch.ones(1, 1, args.seq_length, args.seq_length)) < 0.5).to(torch.bool)
                update_rotary_pos_emb(args.seq_length)
                models[pipeline] = GPTModelPipe(config, num_tokentypes=0, parallel_output=False)
            else:
                models[pipeline] = GPTModel(config, num_tokentypes=0, parallel_output=False)
            models[pipeline].eval()
        return models[pipeline]

    tokens = torch.tensor([json.loads(tokens_file.read_text())])
    seq = tokens.shape[1]
    position_ids = torch.arange(seq).unsqueeze(0)
    mask = torch.tril(torch.ones(1, 1, seq, seq)) < 0.5
    for i, universal in enumerate(universals):
        listing = sorted(p.parent.name for p in (universal / "zero").glob("*/fp32.pt"))
        pipeline = _pipeline_names(listing)
        model = model_for(pipeline)
        live = dict(model.named_parameters())
        if set(live) != set(listing):
            raise SystemExit(f"{universal}: parameters {sorted(set(live) ^ set(listing))} on one side only")
        with torch.no_grad():
            for name, param in live.items():
                master = torch.load(universal / "zero" / name / "fp32.pt", weights_only=False)["param"]
                param.zero_()
                param[: master.shape[0]].copy_(master)
            if pipeline:  # [sequence, batch, vocabulary], the pipeline's activations' order
                logits = model((tokens, position_ids, mask)).transpose(0, 1)
            else:
                logits = model(tokens, position_ids, mask)[0]
        torch.save(logits.float().contiguous(), out / f"{i}.pt")
        kind = "GPTModelPipe" if pipeline else "GPTModel"
        print(f"fork forward ({kind}): {len(live)} parameters from {universal}, logits {tuple(logits.shape)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]])
