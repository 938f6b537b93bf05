"""A tensor-parallel worker group: N processes joined with torch.distributed, one per device.

Rank 0 is the process the supervisor started (`tokenpipe worker --tensor-parallel N`): it
starts ranks 1..N-1 itself (``python -m worker.parallel.follower``, stdout to stderr), joins
them, speaks the JSONL protocol and drives them (``worker/parallel/driver.py``). The group
lives and dies as one:

- a follower that exits while rank 0 still needs it ends rank 0 at once (exit code
  ``GROUP_LOST_EXIT``): the supervisor sees one worker lost and restarts the whole group;
- a follower whose rank 0 is gone (its parent changed, or a collective failed) exits.

Every process of the group runs with NVLink multicast off (``MULTICAST_OFF``). On CUDA the
group's devices are the visible ones (the supervisor pins N GPUs per group), rank r on cuda:r,
tensors through NCCL and the driver's commands through a gloo group; on the CPU, gloo for both.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, NoReturn

import torch
from torch import nn

from worker.models.config import ModelConfig
from worker.parallel.shard import Shard, parallelize

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
SPEC_ENV = "TOKENPIPE_TP_SPEC"
GROUP_LOST_EXIT = 75
"""Rank 0's exit code when a follower died: the supervisor restarts the group."""
_STOPPING = threading.Event()  # rank 0 is ending the group: followers' exits are expected
_IDLE_TIMEOUT = datetime.timedelta(days=365)  # followers wait in a broadcast while rank 0 idles


def _log(message: str) -> None:
    print(f"[tokenpipe worker tp] {message}", file=sys.stderr, flush=True)


class TensorParallelGroup:
    """This process's place in the group, and the group's collectives."""

    def __init__(self, rank: int, world: int, port: int, device_type: str) -> None:
        import torch.distributed as dist

        os.environ.update(MULTICAST_OFF)
        self.rank, self.world, self.device_type = rank, world, device_type
        self.followers: list[subprocess.Popen[bytes]] = []
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=_IDLE_TIMEOUT,
        )
        self.group: Any = dist.group.WORLD  # tensors
        # commands (pickled objects) go through gloo on the host, whatever carries tensors
        self.control: Any = (
            dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT) if backend != "gloo" else None
        )

    # -- loading (the `shard` of worker.loading.loader.load_model) ---------------------------

    def device(self, requested: torch.device) -> torch.device:
        """The rank's device: cuda:rank on CUDA (the group's GPUs are the visible ones)."""
        return torch.device("cuda", self.rank) if requested.type == "cuda" else requested

    def bind(self, config: ModelConfig) -> RankLoad:
        return RankLoad(Shard(config, self.world, self.rank), self)

    # -- commands, rank 0 -> followers --------------------------------------------------------

    def send(self, command: tuple[Any, ...]) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([command], src=0, group=self.control)

    def receive(self) -> tuple[Any, ...]:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return tuple(box[0])

    def gather(self, item: Any) -> list[Any]:
        """Every rank's `item`, in rank order, on rank 0 (followers get [])."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(item, out, dst=0, group=self.control)
        return out or []

    def scatter(self, items: list[Any] | None) -> Any:
        """Rank r's entry of rank 0's `items` (followers pass None)."""
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.scatter_object_list(box, items if self.rank == 0 else None, src=0, group=self.control)
        return box[0]

    # -- lifetime -----------------------------------------------------------------------------

    def watch_parent(self) -> None:
        """A follower: exit when rank 0 (the parent) is gone."""
        parent = os.getppid()

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.2)
            _log(f"rank {self.rank}: rank 0 is gone; exiting")
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()

    def lost(self, exc: BaseException) -> NoReturn:
        """A collective failed: the group is broken, this process ends (never returns)."""
        _log(f"rank {self.rank}: the group failed ({exc!r}); exiting")
        os._exit(GROUP_LOST_EXIT if self.rank == 0 else 1)

    def stop(self, timeout: float = 30.0) -> None:
        """Rank 0 at shutdown: followers told to exit, and waited for."""
        _STOPPING.set()
        try:
            self.send(("stop",))
        except Exception as exc:  # noqa: BLE001 - a follower already gone: nothing to stop
            _log(f"stopping the group: {exc!r}")
        for proc in self.followers:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()


class RankLoad:
    """What load_model needs to build, fill and wire one rank's model."""

    def __init__(self, shard: Shard, group: TensorParallelGroup) -> None:
        self.shard, self.group = shard, group

    def config(self) -> ModelConfig:
        return self.shard.config()

    def tensors(self, pairs: Any, device: torch.device) -> Any:
        return self.shard.tensors(pairs, device)

    def draw_random(
        self, model: nn.Module, device: torch.device, dtype: torch.dtype, seed: int
    ) -> None:
        """`--random-weights`: the full model drawn as one rank would draw it, then sliced
        (every group size gives the same weights; the full model is on the device briefly)."""
        from worker.loading.loader import draw_random_weights
        from worker.models.registry import build_model

        full = build_model(self.shard.full, device, dtype)
        draw_random_weights(full, device, seed)
        tensors = ((name, value) for name, value in full.state_dict().items())
        model.load_weights(self.shard.tensors(tensors, device))  # type: ignore[operator]
        del full

    def parallelize(self, model: nn.Module) -> None:
        parallelize(model, self.shard, self.group.group)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_group(world: int, device_type: str, build: dict[str, Any]) -> TensorParallelGroup:
    """Rank 0: start ranks 1..world-1 (each builds its model from `build`, the keyword
    arguments of ``worker.main.build_engine``) and join them."""
    os.environ.update(MULTICAST_OFF)  # inherited by the followers
    port = _free_port()
    followers = []
    for rank in range(1, world):
        spec = {"rank": rank, "world": world, "port": port, "device": device_type, "build": build}
        env = dict(os.environ, **{SPEC_ENV: json.dumps(spec)})
        followers.append(
            subprocess.Popen(
                [sys.executable, "-m", "worker.parallel.follower"],
                stdin=subprocess.DEVNULL,
                stdout=sys.stderr.fileno(),  # stdout is the protocol's, rank 0's only
                env=env,
            )
        )
    for rank, proc in enumerate(followers, start=1):  # from the rendezvous on
        threading.Thread(target=_watch_follower, args=(proc, rank), daemon=True).start()
    group = TensorParallelGroup(0, world, port, device_type)
    group.followers = followers
    return group


def _watch_follower(proc: subprocess.Popen[bytes], rank: int) -> None:
    """Rank 0: a follower's exit ends this process unless the group is stopping."""
    code = proc.wait()
    if not _STOPPING.is_set():
        _log(f"rank {rank} exited with code {code}; the group goes down")
        os._exit(GROUP_LOST_EXIT)
