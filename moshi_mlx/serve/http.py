"""HTTP helpers every server shares: which hosts are loopback, the loopback-only middleware
(against DNS rebinding) and the browser Origin check for websockets."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from aiohttp import web

from moshi_mlx.serve.guard import EventTally


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (the only hosts that need no https)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_only(tally: EventTally):
    """Middleware for a server bound to loopback: refuse (403) a request whose Host is not a
    loopback name, so a page whose domain was re-pointed at 127.0.0.1 cannot reach it."""

    @web.middleware
    async def refuse_other_hosts(request: web.Request, handler) -> web.StreamResponse:
        name = _host_port(request.host or "", 80)[0]
        if not is_loopback(name):
            tally.count("requests refused for a host that is not localhost", request.remote)
            raise web.HTTPForbidden(text=f"this server answers only for localhost, not {name}")
        return await handler(request)

    return refuse_other_hosts


def origin_allowed(origin: str | None, host: str | None) -> bool:
    """A browser's websocket must come from a page of this server: Origin's host:port == Host.

    Clients that send no Origin (`moshi.client`, the Rust CLI) are not browsers and pass.
    """
    if origin is None:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc or host is None:
        return False
    default_port = {"http": 80, "https": 443}[parts.scheme]
    return _host_port(parts.netloc, default_port) == _host_port(host, default_port)


def _host_port(netloc: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit(f"//{netloc}")
    try:
        port = parts.port or default_port
    except ValueError:
        port = -1
    return (parts.hostname or "").lower(), port
