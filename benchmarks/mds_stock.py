"""Stock DeepSpeed beside megatron-ucp on the real Megatron-DeepSpeed, for the benchmarks that put both outcomes in
one table (``layout_moves.py``, ``zero3_outcomes.py``): DeepSpeed's own converter run as its documentation says, and
a run's outcome in one short cell."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

from tests.integration.mds import Checkout, rank_env

_ERROR = re.compile(r"([A-Za-z_.]*(?:Error|Exception)): (.{0,160})")


def first_error(log: str) -> str:
    """``stops: <Error>: <message>`` of the first error line of a log (a run that stopped)."""
    for line in log.splitlines():
        m = _ERROR.search(line)
        if m and "Warning" not in m.group(1):
            return f"stops: {m.group(1).split('.')[-1]}: {m.group(2).strip()}"
    return "stops (no error line)"


def short(text: str) -> str:
    """Error lines name files under the working folder: keep the part inside the checkpoint."""
    return re.sub(r"'?/\S*?/(global_step\d+(?:_universal)?/\S*?)'?(?=\s|$)", r"`\1`", text).replace("|", "/")


def stock_convert(co: Checkout, tag_dir: Path, output: Path) -> Optional[str]:
    """``python -m deepspeed.checkpoint.ds_to_universal`` on a tag, the fork on ``PYTHONPATH`` (its pickled
    ``args``); None when it converted, else its outcome cell."""
    env = rank_env({"PYTHONPATH": os.pathsep.join([str(co.root), rank_env()["PYTHONPATH"]])})
    converted = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(tag_dir),
            "--output_folder",
            str(output),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
        ],
        cwd=co.root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if converted.returncode != 0:
        return "ds_to_universal " + first_error(converted.stdout + converted.stderr)
    return None
