"""A server's caps and deadlines (`Limits`), and fitting them to the process's file-descriptor
limit (the flags that set them are `moshi_mlx.cli.common.add_limit_args`)."""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Callable
from dataclasses import dataclass, replace

# Descriptors kept free of connections for the model's files, logs, pipes and the like.
DESCRIPTOR_RESERVE = 64


@dataclass(frozen=True)
class Limits:
    """Caps and deadlines for every connection of a server."""

    max_connections: int = 256
    header_timeout: float = 10.0  # seconds from connect to the end of the first request's headers
    idle_timeout: float = 15.0  # seconds a keep-alive connection may wait for its next request
    # Seconds without audio from a client in a conversation; a websocket peer that sends
    # nothing for half of it is pinged and must answer within a quarter of it.
    client_silence_timeout: float = 5.0


def fit_to_descriptor_limit(limits: Limits) -> tuple[Limits, int]:
    """(`limits` with at most as many connections as fit the process's descriptor limit beside
    a reserve, that limit). The soft limit is raised towards the hard one first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = limits.max_connections + DESCRIPTOR_RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        with contextlib.suppress(ValueError, OSError):  # macOS refuses more than OPEN_MAX
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    if soft == resource.RLIM_INFINITY:
        return limits, soft
    fitting = max(1, soft - min(DESCRIPTOR_RESERVE, soft // 4))
    return replace(limits, max_connections=min(limits.max_connections, fitting)), soft


def fitted_limits(limits: Limits, say: Callable[[str], None]) -> Limits:
    """`fit_to_descriptor_limit`'s limits, with `say` telling the user when it lowered them."""
    fitting, descriptors = fit_to_descriptor_limit(limits)
    if fitting.max_connections < limits.max_connections:
        say(
            f"at most {fitting.max_connections} connections: the process may open "
            f"{descriptors} files (ulimit -n)"
        )
    return fitting
