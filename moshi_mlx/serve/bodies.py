"""msgpack decoding with a bound on what one client message may decode into.

msgpack's own limits cap each array, map, string and binary, but not how many containers a
message holds: 3.8 MB of nested empty arrays decodes into millions of Python lists (hundreds of
MB). `unpack_bounded` also counts containers and stops at `max_containers`.
"""

from __future__ import annotations

import msgpack


class TooManyContainers(ValueError):
    """A message holding more arrays and maps than its protocol ever sends."""


def unpack_bounded(data: bytes, max_containers: int, **limits: int) -> object:
    """`msgpack.unpackb(data, raw=False, **limits)` that raises `TooManyContainers` once the
    message has decoded more than `max_containers` arrays and maps (it stops there, so memory
    stays bounded by the message's size)."""
    decoded = 0

    def count(container):
        nonlocal decoded
        decoded += 1
        if decoded > max_containers:
            raise TooManyContainers(f"more than {max_containers} arrays and maps in one message")
        return container

    return msgpack.unpackb(data, raw=False, list_hook=count, object_hook=count, **limits)
