"""Build a cache file exactly once when many processes (on many hosts) want it at once.

Correctness rests on the atomic rename alone: every builder writes a private temp file and
``os.replace``-s it into place, so readers only ever see a missing or a complete file, and two
builders that race produce the same bytes. The O_EXCL lock file is an optimisation that keeps
N ranks from all building the same corpus; losing it to a mistaken stale-lock takeover costs
duplicate work, never a corrupt cache.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

log = logging.getLogger(__name__)

# How long waiters wait for another process's build before giving up (seconds).
DEFAULT_TIMEOUT_S = 1800.0
# A lock whose file has not changed for this long is considered abandoned (seconds). The
# builder touches its lock every HEARTBEAT_S, so only a dead or frozen builder gets here.
DEFAULT_STALE_AFTER_S = 120.0
HEARTBEAT_S = 5.0
# Interval between checks while waiting (seconds).
DEFAULT_POLL_S = 0.2
# How often a waiter says why it is still waiting (seconds).
_WAIT_LOG_EVERY_S = 30.0


def host_id() -> str:
    """Identify this machine: hostnames alone can collide between containers on different
    nodes, and a pid is only meaningful on the machine that issued it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def ensure_file(
    path: str | os.PathLike[str],
    build: Callable[[str], None],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
    poll_s: float = DEFAULT_POLL_S,
) -> bool:
    """Make ``path`` exist, calling ``build(temp_path)`` in at most one process at a time.

    Returns True if this process built the file. Raises TimeoutError if another process holds
    the build lock, keeps it alive, and does not finish within ``timeout_s``.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    lock_path = path + ".lock"
    me = host_id()
    deadline = time.monotonic() + timeout_s
    seen_signature: tuple[int, int, int] | None = None
    seen_since = time.monotonic()
    last_log = time.monotonic()
    while True:
        if os.path.exists(path):
            return False
        token = _try_lock(lock_path, me)
        if token is not None:
            try:
                # The previous holder may have published and unlocked between our
                # existence check and our lock, so look again before building.
                if os.path.exists(path):
                    return False
                _build_locked(path, lock_path, build)
                return True
            finally:
                _unlock(lock_path, token)
        holder, signature = _read_lock(lock_path)
        if signature is None:
            continue  # released between our O_EXCL attempt and the read: retry at once
        now = time.monotonic()
        if signature != seen_signature:
            seen_signature, seen_since = signature, now
        reason = _stale_reason(holder, me, now - seen_since, stale_after_s)
        if reason is not None:
            _break_lock(lock_path, signature, holder, reason)
            continue
        if now >= deadline:
            raise TimeoutError(
                f"gave up after {timeout_s:.0f} s waiting for another process to build "
                f"{path!r}: the lock {lock_path!r} is held by {_describe(holder)} and still "
                f"alive. If no such build is running, delete the lock file and retry."
            )
        if now - last_log >= _WAIT_LOG_EVERY_S:
            log.info("waiting for %s to build %s", _describe(holder), path)
            last_log = now
        time.sleep(poll_s)


def _try_lock(lock_path: str, me: str) -> str | None:
    """Create the lock file exclusively; returns our token on success, None if it exists."""
    try:
        fd = os.open(lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    token = uuid.uuid4().hex
    info = {"host": me, "pid": os.getpid(), "token": token, "started": time.time()}
    with os.fdopen(fd, "w") as handle:
        json.dump(info, handle)
    return token


def _build_locked(path: str, lock_path: str, build: Callable[[str], None]) -> None:
    # Unique per process so a crashed builder's leftovers never collide with a live one.
    tmp = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(lock_path, stop), daemon=True)
    beat.start()
    try:
        build(tmp)
        os.replace(tmp, path)
    finally:
        stop.set()
        beat.join()
        if os.path.exists(tmp):
            os.unlink(tmp)


def _heartbeat(lock_path: str, stop: threading.Event) -> None:
    # A thread rather than touches between files: one huge file read on a slow filesystem
    # must not make a live build look abandoned.
    while not stop.wait(HEARTBEAT_S):
        try:
            os.utime(lock_path)
        except OSError:
            return  # lock broken by a waiter; our result is still valid (see module doc)


def _unlock(lock_path: str, token: str) -> None:
    # Only remove our own lock: after a (mistaken) takeover the file may be someone else's.
    holder, _ = _read_lock(lock_path)
    if holder is not None and holder.get("token") == token:
        try:
            os.unlink(lock_path)
        except FileNotFoundError:
            pass


def _read_lock(lock_path: str) -> tuple[dict | None, tuple[int, int, int] | None]:
    """The holder's info (None if not yet written or unreadable) and the file's identity."""
    try:
        st = os.stat(lock_path)
        with open(lock_path) as handle:
            text = handle.read()
    except FileNotFoundError:
        return None, None
    signature = (st.st_ino, st.st_mtime_ns, st.st_size)
    try:
        holder = json.loads(text)
    except ValueError:
        # Created but not yet written; only the age rule can judge it.
        holder = None
    return (holder if isinstance(holder, dict) else None), signature


def _stale_reason(holder: dict | None, me: str, unchanged_s: float, stale_after_s: float) -> str | None:
    if holder is not None and holder.get("host") == me and not _pid_alive(holder.get("pid")):
        return f"its builder pid {holder.get('pid')} on this host is gone"
    # Judged by how long *we* have watched it unchanged, on our own monotonic clock: lock
    # mtimes on a shared filesystem come from other machines' clocks, which may be skewed.
    if unchanged_s >= stale_after_s:
        return f"it has not been refreshed for {unchanged_s:.0f} s"
    return None


def _pid_alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def _break_lock(lock_path: str, signature: tuple[int, int, int], holder: dict | None, reason: str) -> None:
    # Rename first (atomic, one winner), then confirm we moved the lock we judged and not a
    # fresh one that replaced it meanwhile; if we did, put it back.
    aside = f"{lock_path}.stale.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        os.rename(lock_path, aside)
    except FileNotFoundError:
        return  # someone else broke or released it
    try:
        st = os.stat(aside)
        if (st.st_ino, st.st_mtime_ns, st.st_size) != signature:
            try:
                os.link(aside, lock_path)  # fails if yet another lock exists; then just drop it
            except OSError:
                pass
            return
        log.warning("removing stale cache lock %s held by %s: %s", lock_path, _describe(holder), reason)
        _remove_partial(lock_path, holder)
    finally:
        try:
            os.unlink(aside)
        except FileNotFoundError:
            pass


def _remove_partial(lock_path: str, holder: dict | None) -> None:
    """Delete the temp file(s) a dead builder left behind, so they do not pile up."""
    if holder is None:
        return
    path = lock_path[: -len(".lock")]
    folder = os.path.dirname(path) or "."
    prefix = f"{os.path.basename(path)}.tmp."
    pid_part = f".{holder.get('pid')}."
    host_name = str(holder.get("host", "")).split("/")[0]
    for name in os.listdir(folder):
        if name.startswith(prefix) and f".{host_name}{pid_part}" in name:
            try:
                os.unlink(os.path.join(folder, name))
            except FileNotFoundError:
                pass


def _describe(holder: dict | None) -> str:
    if holder is None:
        return "an unknown process"
    return f"pid {holder.get('pid')} on host {holder.get('host')}"
