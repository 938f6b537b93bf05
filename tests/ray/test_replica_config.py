"""A replica's --session-dir (supervisor/ray/replica.py, no cluster): a directory per Serve
rank, so a replacement (which Ray gives its predecessor's rank) finds the sessions it saved,
and two replicas on one node never share one."""

from __future__ import annotations

from supervisor.config import SupervisorConfig, plan_specs
from supervisor.ray.replica import replica_config


def test_each_rank_has_its_own_directory() -> None:
    base = SupervisorConfig(workers=2, session_dir="/s", worker_command=("w",))
    assert replica_config(base, 0, "abc").session_dir == "/s/rank-0"
    assert replica_config(base, 3, "abc").session_dir == "/s/rank-3"
    assert replica_config(base, None, "abc").session_dir == "/s/replica-abc"
    argv = plan_specs(replica_config(base, 1, "abc"))[1].argv
    assert argv[-2:] == ("--session-dir", "/s/rank-1/worker-1")
    passed = SupervisorConfig(workers=1, worker_args=("--session-dir=/t", "--threads", "1"))
    mine = replica_config(passed, 2, "abc")
    assert mine.session_dir == "/t/rank-2" and mine.worker_args == ("--threads", "1")
    none = SupervisorConfig(workers=1)
    assert replica_config(none, 0, "abc") is none
