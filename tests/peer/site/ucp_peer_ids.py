"""A pytest plugin for the peer-suite runner: the collected node ids into ``$UCP_PEER_IDS``, one per line (DeepSpeed's
conftest makes pytest's own listing verbose)."""

import os


def pytest_collection_finish(session) -> None:
    out = os.environ.get("UCP_PEER_IDS")
    if out:
        with open(out, "w") as fh:
            fh.write("\n".join(item.nodeid for item in session.items) + "\n")
