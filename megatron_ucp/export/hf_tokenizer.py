"""The run's tokenizer as Hugging Face files, when it is a file on disk.

Megatron-DeepSpeed names its tokenizer in the saved args (``tokenizer_type``, ``tokenizer_model``,
``vocab_file``/``merge_file``). An export carries it only from disk: compute nodes have no network, and a
tokenizer fetched by name could differ from the one the run used. Each kind the fork offers is one entry of
:data:`_KINDS`; anything else is exported without tokenizer files, and the summary says so.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

_HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
)


@dataclass(frozen=True)
class TokenizerExport:
    """What the export writes for the tokenizer: files copied (destination name -> source), small JSON files,
    the token ids ``config.json`` and ``generation_config.json`` name, and a line for the summary."""

    copies: dict[str, Path] = field(default_factory=dict)
    json_files: dict[str, dict] = field(default_factory=dict)
    token_ids: dict[str, int] = field(default_factory=dict)
    summary: str = "no tokenizer files"


def _sentencepiece(args: dict, max_length: int) -> Optional[TokenizerExport]:
    model = Path(str(args.get("tokenizer_model") or ""))
    if not model.is_file():
        return None
    ids = _sentencepiece_ids(model)
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": True,
        "model_max_length": max_length,
    }
    return TokenizerExport(
        copies={"tokenizer.model": model},
        json_files={"tokenizer_config.json": config},
        token_ids=ids,
        summary=f"tokenizer {model.name} (sentencepiece)",
    )


def _sentencepiece_ids(model: Path) -> dict[str, int]:
    """bos/eos ids from the model file when ``sentencepiece`` is installed; Llama's (1, 2) otherwise (logged)."""
    try:
        import sentencepiece  # optional: only to read the ids the model file declares
    except ImportError:
        log.info("sentencepiece is not installed: bos/eos ids of %s taken as Llama's (1, 2)", model)
        return {"bos_token_id": 1, "eos_token_id": 2}
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    return {k: v for k, v in (("bos_token_id", sp.bos_id()), ("eos_token_id", sp.eos_id())) if v >= 0}


def _hf_folder(args: dict, max_length: int) -> Optional[TokenizerExport]:
    folder = Path(str(args.get("tokenizer_model") or ""))
    if not folder.is_dir():
        return None
    copies = {name: folder / name for name in _HF_TOKENIZER_FILES if (folder / name).is_file()}
    if not copies:
        return None
    return TokenizerExport(copies=copies, summary=f"tokenizer files of {folder} ({len(copies)})")


def _gpt2_bpe(args: dict, max_length: int) -> Optional[TokenizerExport]:
    vocab, merges = Path(str(args.get("vocab_file") or "")), Path(str(args.get("merge_file") or ""))
    if not (vocab.is_file() and merges.is_file()):
        return None
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": max_length}
    return TokenizerExport(
        copies={"vocab.json": vocab, "merges.txt": merges},
        json_files={"tokenizer_config.json": config},
        summary="GPT-2 BPE vocab.json and merges.txt",
    )


def _null(args: dict, max_length: int) -> Optional[TokenizerExport]:
    eod = int(args.get("vocab_size") or 0)  # the NullTokenizer's end-of-document id follows its vocabulary
    return TokenizerExport(
        token_ids={"bos_token_id": eod, "eos_token_id": eod},
        summary="no tokenizer files (NullTokenizer: token ids are the text)",
    )


_KINDS: dict[str, Callable[[dict, int], Optional[TokenizerExport]]] = {
    "Llama2Tokenizer": _sentencepiece,
    "GPTSentencePieceTokenizer": _sentencepiece,
    "SentencePieceTokenizer": _sentencepiece,
    "HFTokenizer": _hf_folder,
    "GPT2BPETokenizer": _gpt2_bpe,
    "NullTokenizer": _null,
}


def tokenizer_export(args: dict[str, Any], max_length: int) -> TokenizerExport:
    """The tokenizer files of the run whose Megatron ``args`` these are (see the module docstring)."""
    kind = str(args.get("tokenizer_type") or "")
    found = _KINDS.get(kind, lambda *_: None)(args, max_length)
    if found is None:
        where = args.get("tokenizer_model") or args.get("vocab_file")
        summary = f"no tokenizer files ({kind or 'no tokenizer type'}{f': {where} is not on disk' if where else ''})"
        log.info("export: %s", summary)
        return TokenizerExport(summary=summary)
    return found


def write_tokenizer(found: TokenizerExport, folder: Path) -> list[str]:
    """Copy and write the tokenizer files into ``folder``; their names."""
    for name, source in found.copies.items():
        shutil.copyfile(source, folder / name)
    for name, content in found.json_files.items():
        (folder / name).write_text(json.dumps(content, indent=2) + "\n")
    return sorted({*found.copies, *found.json_files})
