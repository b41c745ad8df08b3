"""The Hugging Face hub as this process sees it: reachable or not, found out once.

The hub client retries a refused connection for about 25 s, and logs each try, before it
looks in its cache. Here the first hub access of a process sends one short request to the
hub's endpoint (through the hub client's own session, so its proxy settings hold); when that
fails, or `HF_HUB_OFFLINE` is set, or a later download fails to connect, the hub is taken for
down for the rest of the process and files come from the local cache only, at once.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from moshi_mlx.errors import one_line

log = logging.getLogger("moshi_mlx.checkpoints")
PROBE_SECONDS = 3.0  # how long the first hub access waits for any answer of the endpoint


class HubMiss(Exception):
    """A hub file that cannot be had: `why` is "offline" (the hub cannot be reached and the
    file is not cached), "no repo", "no file" or "failed"; `detail` says more, on one line."""

    def __init__(self, why: str, detail: str):
        super().__init__(f"{why}: {detail}")
        self.why, self.detail = why, detail


class _HubState:
    """Whether the hub is down, and why (None: not known to be down), asked once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._probed = False
        self.down: str | None = None

    def check(self) -> str | None:
        """Why the hub cannot be reached, or None; probes on the first call only."""
        with self._lock:
            if not self._probed:
                self._probed = True
                self.down = self.down or _probe()
            return self.down

    def mark_down(self, reason: str) -> None:
        with self._lock:
            self._probed, self.down = True, reason


_HUB = _HubState()


def _probe() -> str | None:
    """Why one short request to the hub's endpoint fails (None: it answered, any status)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        get_session().head(constants.ENDPOINT, timeout=PROBE_SECONDS)
    except Exception as exc:  # noqa: BLE001 - any transport error (DNS, refused, timeout)
        return f"no answer from {constants.ENDPOINT}: {one_line(exc)}"
    return None


def hub_down() -> str | None:
    """Why the Hugging Face hub cannot be reached from this process (None: it can), found
    out on the first call and remembered."""
    return _HUB.check()


def download(repo: str, filename: str) -> Path:
    """`filename` of the hub repo `repo`, from the Hugging Face cache (filled on the way);
    only from the cache when the hub is down. `HubMiss` says why it cannot be had."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import (  # where every release since 0.24 has them
        EntryNotFoundError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    down = hub_down()
    try:
        return Path(hf_hub_download(repo, filename, local_files_only=down is not None))
    except LocalEntryNotFoundError as exc:
        if down is None:  # the download could not connect: the hub went down since
            down = one_line(exc.__cause__ or exc)
            _HUB.mark_down(down)
        raise HubMiss("offline", down) from None
    except RepositoryNotFoundError as exc:  # also a gated or private repo without a token
        raise HubMiss("no repo", one_line(exc).split(" (Request ID")[0]) from None
    except EntryNotFoundError as exc:
        raise HubMiss("no file", one_line(exc)) from None
    except Exception as exc:  # noqa: BLE001 - HTTP or disk errors
        raise HubMiss("failed", f"{type(exc).__name__}: {one_line(exc)}") from None


def cached(repo: str, filename: str) -> Path | None:
    """`filename` of the hub repo `repo` when the Hugging Face cache holds it (no request)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, filename)
    return Path(found) if isinstance(found, str) else None


def cached_files(repo: str) -> list[str]:
    """The files of the hub repo `repo` in the local Hugging Face cache."""
    try:
        from huggingface_hub import scan_cache_dir

        cache = scan_cache_dir()
    except Exception:  # noqa: BLE001 - no cache at all
        return []
    return [
        file.file_path.relative_to(revision.snapshot_path).as_posix()
        for cached in cache.repos
        if cached.repo_id == repo
        for revision in cached.revisions
        for file in revision.files
    ]


def repo_files(repo: str) -> list[str]:
    """The files of the hub repo `repo`: listed by the hub, or the cached ones when the hub
    is down or the listing fails."""
    if hub_down() is None:
        try:
            from huggingface_hub import HfApi

            return list(HfApi().list_repo_files(repo))
        except Exception as exc:  # noqa: BLE001 - offline since, unknown repo: what is cached
            log.warning("cannot list the files of %s (%s)", repo, type(exc).__name__)
    return cached_files(repo)
