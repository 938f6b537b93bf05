"""What a request sticks to, and what a lost replica looks like (pure but for Ray's types).

The session key follows `tokenpipe serve`'s own rule (supervisor/openai/sessions.py): the
body's `session_id`, else the first session header (`x-session-affinity`, `session_id`, ...).
A protocol request's key is its `session_id`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

from supervisor.openai.sessions import SESSION_HEADERS

from .ring import HashRing

SESSION_KEY = "session_key"
"""The keyword argument of a replica call that names its session (the router reads it).
Defined here, not in router.py, so the front ends import no Ray before they connect."""


def session_digest(session: str) -> str:
    """A short, fixed-size name of a session for replica metadata (a replica lists the
    sessions its --session-dir held at start; the router sends them there)."""
    return hashlib.blake2b(session.encode(), digest_size=8).hexdigest()


def session_owner(key: str, saved: Mapping[str, str], ring: HashRing) -> str | None:
    """The ring name of the replica for session `key`: the live one whose --session-dir held
    the session when it started (`saved`: digest -> ring name), else the ring's owner."""
    holder = saved.get(session_digest(key)) if saved else None
    return holder if holder is not None and holder in ring.nodes else ring.owner(key)


def http_session_key(headers: Mapping[str, str], body: bytes) -> str | None:
    """The session an OpenAI request names, or None (routed to the least-loaded replica)."""
    if b'"session_id"' in body:  # parse only bodies that can name one
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("session_id"), str):
            return parsed["session_id"] or None
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return value
    return None


def request_session_key(request: Mapping[str, Any]) -> str | None:
    session = request.get("session_id")
    return session if isinstance(session, str) and session else None


def is_replica_lost(exc: BaseException) -> bool:
    """True when `exc` says the replica process went away (not a failure inside it)."""
    from ray import exceptions

    return isinstance(exc, (exceptions.RayActorError, exceptions.ActorUnavailableError))
