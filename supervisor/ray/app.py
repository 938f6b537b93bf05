"""The Ray side of `tokenpipe ray up`: starting or joining a cluster, and the Serve application:
the replica deployment (each replica with its own HTTP and JSONL ports) and the HTTP front end
that sends each request straight to its replica's port (http_front.py); with `via_serve`, Serve's
proxy and the replica deployment as the HTTP ingress instead (ingress.py).

Kept light for small machines: no dashboard, a small object store, and the replicas'
CPU share is what their workers use (one per CPU worker). Serve's controller, the front end,
the proxy and the ingress reserve no CPU.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from supervisor.core import SupervisorConfig
from supervisor.openai.app import ServerConfig
from supervisor.openai.sessions import SESSION_HEADERS

APP_NAME = "tokenpipe"
REPLICA_DEPLOYMENT = "TokenpipeReplica"
FRONT_DEPLOYMENT = "TokenpipeHttpFront"  # the direct path's HTTP front end
INGRESS_DEPLOYMENT = "TokenpipeIngress"  # only with via_serve and separate_ingress
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's marker resource of the head node
AUTH_TOKEN_FILE = "~/.ray/auth_token"  # where Ray keeps this machine's cluster token
AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
SESSION_HEADER_ENV = "RAY_SERVE_SESSION_ID_HEADER_KEY"
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
OBJECT_STORE_BYTES = 128 << 20  # events and request bodies are small; Ray's minimum is 75 MiB


@dataclass(frozen=True)
class Deployment:
    """What `tokenpipe ray up` deploys."""

    replicas: int
    supervisor: SupervisorConfig
    server: ServerConfig
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    max_ongoing_requests: int = 64  # per replica, like the supervisor's --max-queue
    http: bool = True  # the OpenAI API on the port; False: the JSONL front end only
    # HTTP through Ray Serve's proxy and a Serve call per request (ingress.py) instead of the
    # direct path (http_front.py straight to each replica's own port): for clusters whose
    # nodes reach each other only on Ray's ports
    via_serve: bool = False
    # with via_serve: an ingress deployment in front of the replicas (ingress.py,
    # SeparateIngress): a lost replica answered worker_lost, at one more actor hop
    separate_ingress: bool = False
    health_check_period_s: float = 2.0  # how soon a dead replica is seen (and replaced)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.cpus_per_replica < 0 or self.gpus_per_replica < 0:
            raise ValueError("cpus_per_replica and gpus_per_replica must be >= 0")
        if self.separate_ingress and not self.via_serve:
            raise ValueError("separate_ingress is a way of the via_serve path: set both")


def connect(address: str | None, num_cpus: int | None = None, node_ip: str = "127.0.0.1") -> str:
    """Join the cluster at `address`, or start a local one (this process is its head, its
    processes on `node_ip`: loopback unless other nodes must reach it); the cluster's
    address for `--address`."""
    loopback = node_ip.startswith("127.") if not address else address.startswith("127.")
    if loopback:
        # Ray resolves 127.0.0.1 to the machine's outward address, where every Ray process
        # would listen, unless its "cluster" mode is off: then all of them stay on loopback.
        os.environ[LOOPBACK_ONLY_ENV] = "0"
        if "ray._private.ray_constants" in sys.modules:
            sys.modules["ray._private.ray_constants"].ENABLE_RAY_CLUSTER = False
    if address:
        use_cluster_token()
    else:
        # Serve's proxy (in this new cluster) routes by this header: a session-affine
        # request goes straight to its replica (supervisor/ray/ingress.py)
        os.environ.setdefault(SESSION_HEADER_ENV, SESSION_HEADERS[0])
    import ray

    common: dict[str, Any] = {
        "include_dashboard": False,
        "logging_level": logging.WARNING,
        "log_to_driver": False,
        "configure_logging": True,
    }
    if address:
        ray.init(address=address, **common)
    else:
        ray.init(
            num_cpus=num_cpus,
            object_store_memory=OBJECT_STORE_BYTES,
            _node_ip_address=node_ip,
            **common,
        )
    return str(ray.get_runtime_context().gcs_address)


def has_cluster_token(env: Mapping[str, str] | None = None) -> bool:
    """True when this machine holds a Ray cluster token: `RAY_AUTH_TOKEN`, the file at
    `RAY_AUTH_TOKEN_PATH`, or `~/.ray/auth_token` (where a new local cluster writes it)."""
    env = os.environ if env is None else env
    if env.get(AUTH_TOKEN_ENV):
        return True
    path = env.get(AUTH_TOKEN_PATH_ENV) or os.path.expanduser(AUTH_TOKEN_FILE)
    return os.path.isfile(path)


def use_cluster_token() -> None:
    """Join a cluster with token authentication when a token is at hand.

    Ray >= 2.5x starts local clusters with token authentication and sets RAY_AUTH_MODE=token
    in its own process (its children inherit it), but a process that joins with an explicit
    address never turns it on by itself: it connects without the token and is refused
    (`InvalidAuthToken`). So a token found here turns token mode on, unless RAY_AUTH_MODE was
    set explicitly. Ray's C++ config reads the mode once, when `ray._raylet` is imported:
    when that already happened, the config is read again (as Ray's own `ray.init` does).
    A cluster without authentication ignores the token.
    """
    if os.environ.get(AUTH_MODE_ENV) is not None or not has_cluster_token():
        return
    os.environ[AUTH_MODE_ENV] = "token"
    raylet = sys.modules.get("ray._raylet")
    if raylet is not None:
        raylet.Config.initialize("")


def application(spec: Deployment, host: str = "127.0.0.1", port: int = 8000) -> Any:
    """The Serve application (`serve.run`-able). The direct path (the default): the replicas,
    each with its own HTTP and JSONL ports, and with `http` the HTTP front end on `host:port`
    (on the head node) that passes each request to its replica's port."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from .http_front import HttpFront
    from .ingress import SeparateIngress
    from .replica import TokenpipeReplica
    from .router import SessionAffinityRouter

    direct_http = spec.http and not spec.via_serve

    replica = serve.deployment(
        TokenpipeReplica,
        name=REPLICA_DEPLOYMENT,
        num_replicas=spec.replicas,
        max_ongoing_requests=spec.max_ongoing_requests,
        ray_actor_options={"num_cpus": spec.cpus_per_replica, "num_gpus": spec.gpus_per_replica},
        request_router_config=RequestRouterConfig(request_router_class=SessionAffinityRouter),
        health_check_period_s=spec.health_check_period_s,
        graceful_shutdown_timeout_s=30,
    ).bind(spec.supervisor, spec.server, direct_http)
    if direct_http:
        return serve.deployment(
            HttpFront,
            name=FRONT_DEPLOYMENT,
            num_replicas=1,
            ray_actor_options={"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}},
            health_check_period_s=spec.health_check_period_s,
        ).bind(replica, host, port, spec.server.max_body_bytes)
    if not (spec.http and spec.separate_ingress):
        return replica  # also the HTTP ingress (ingress.py): one actor hop from Serve's proxy
    return serve.deployment(
        SeparateIngress,
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=1024,
        ray_actor_options={"num_cpus": 0},
    ).bind(replica, spec.server.max_body_bytes)


def deploy(spec: Deployment, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Deploy (or update: a new replica count scales in place) and wait until it runs."""
    from ray import serve

    if spec.http and spec.via_serve:
        serve.start(http_options={"host": host, "port": port})
    else:
        serve.start(proxy_location="Disabled")
    routed = spec.http and spec.via_serve
    serve.run(application(spec, host, port), name=APP_NAME, route_prefix="/" if routed else None)


def replica_handle() -> Any:
    """A handle on the replicas (routed by `SessionAffinityRouter`)."""
    from ray import serve

    return serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=APP_NAME)
