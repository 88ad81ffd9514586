"""The proof of a Hugging Face export against the real fork: its logits are the fork's own ``GPTModel`` forward's.

:func:`fork_logits` runs ``fork_forward.py`` (one process, the fork's model built once, fed each universal folder's
fp32 masters); :func:`assert_computes` loads an export with ``transformers`` (no network) and compares, in fp32,
over the tokenizer's rows. Shared by the model-parallel and ZeRO-3 tests, whose trainings it reuses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import torch

from tests.integration.mds import CORPUS_TOKENS, Checkout, rank_env

FORWARD = Path(__file__).with_name("fork_forward.py")
TOKENS = [(7 * k + 3) % CORPUS_TOKENS for k in range(32)]
RELATIVE = 1e-4


def fork_logits(co: Checkout, universals: Sequence[Path], tmp: Path) -> list[torch.Tensor]:
    out = tmp / "fork-logits"
    out.mkdir(parents=True, exist_ok=True)
    tokens = tmp / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    env = rank_env({"PYTHONPATH": f"{rank_env()['PYTHONPATH']}:{co.root}"})
    done = subprocess.run(
        [sys.executable, str(FORWARD), str(tokens), str(out), *map(str, universals)],
        cwd=co.root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [torch.load(out / f"{i}.pt") for i in range(len(universals))]


def same_files(a: Path, b: Path) -> list[str]:
    """The files of two exports that differ in bytes (their markers, which name the source, aside)."""
    names = sorted({p.name for p in (*a.iterdir(), *b.iterdir())} - {"ucp_export.json"})
    return [
        n
        for n in names
        if not ((a / n).is_file() and (b / n).is_file() and (a / n).read_bytes() == (b / n).read_bytes())
    ]


def assert_computes(export: Path, want: torch.Tensor) -> float:
    """The export's logits equal ``want`` (the fork's, padded vocabulary) within :data:`RELATIVE`; the error."""
    import huggingface_hub.constants
    import transformers

    assert huggingface_hub.constants.HF_HUB_OFFLINE is True  # read at its import: tests/conftest.py set it first
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        got = model(torch.tensor([TOKENS])).logits
    vocab = model.config.vocab_size
    assert got.shape == (1, len(TOKENS), vocab), got.shape
    error = ((got - want[..., :vocab]).abs().max() / want[..., :vocab].abs().max()).item()
    assert error <= RELATIVE, (export, error)
    return error
