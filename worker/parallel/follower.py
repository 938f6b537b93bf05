"""`python -m worker.parallel.follower`: ranks 1..N-1 of a group, started by rank 0.

The rank, the group's rendezvous and the build arguments come in ``TOKENPIPE_TP_SPEC``
(``worker/parallel/group.py``). A follower never writes to stdout (rank 0 sends it to stderr).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    spec = json.loads(os.environ.pop("TOKENPIPE_TP_SPEC"))
    from worker.main import build_engine, log
    from worker.parallel.driver import follow
    from worker.parallel.group import TensorParallelGroup

    group = TensorParallelGroup(spec["rank"], spec["world"], spec["port"], spec["device"])
    group.watch_parent()
    try:
        model, device = build_engine(**spec["build"], group=group)  # type: ignore[misc]
    except Exception as exc:  # noqa: BLE001 - rank 0 sees this rank go and fails its start
        log(f"rank {group.rank} failed to start: {exc!r}")
        sys.exit(1)
    sys.exit(follow(model, group, device))


if __name__ == "__main__":
    main()
