"""Single-copy reads from a peer process's memory: Linux cross-memory attach (CMA).

``process_vm_readv(2)`` (Linux 3.2+, glibc 2.15+) copies bytes from another process's address
space straight into this one's, in one kernel copy, with no shared buffer in between. The shared
memory transport (:class:`fstrain.distributed.comm.shm.ShmBackend`) uses it so that a receiver
pulls each peer's rows from the peer's own input tensor into its output tensor: one copy per byte
instead of the two of a copy-in/copy-out ring.

The kernel allows it only where ``ptrace`` access would be allowed ("PTRACE_MODE_ATTACH_REALCREDS":
same user, and Yama's ``ptrace_scope`` / a seccomp filter / a container profile not forbidding it).
Whether it works is therefore probed at start-up, between the real processes (:class:`CmaProbe`,
:func:`probe_peer`); the transport falls back to its rings when any rank's probe fails.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import sys

from fstrain.distributed.comm.base import CommError

_NONCE_BYTES = 16
logger = logging.getLogger(__name__)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_readv = None


def _process_vm_readv():
    """libc's ``process_vm_readv`` through ctypes (loaded once). Raises `OSError` where it is absent."""
    global _readv
    if _readv is None:
        if not sys.platform.startswith("linux"):
            raise OSError(f"process_vm_readv is Linux-only (this is {sys.platform})")
        try:
            fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
        except AttributeError as e:
            raise OSError(f"the C library has no process_vm_readv ({e})") from e
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                       ctypes.c_ulong, ctypes.c_ulong]
        _readv = fn
    return _readv


class PeerReader:
    """Reads byte ranges of one process's memory into this process's memory (reusable iovecs)."""

    def __init__(self):
        self._fn = _process_vm_readv()
        self._local, self._remote = _IoVec(), _IoVec()
        self._local_p, self._remote_p = ctypes.pointer(self._local), ctypes.pointer(self._remote)

    def read(self, pid: int, remote_address: int, local_address: int, num_bytes: int) -> None:
        """Copy ``num_bytes`` from ``remote_address`` in process ``pid`` to ``local_address`` here.

        Raises:
            OSError: the kernel refused or failed the read (``EPERM``: no ptrace permission,
                ``ESRCH``: no such process, ``EFAULT``: an address outside the mapped memory,
                ``ENOSYS``: no CMA in this kernel or a seccomp filter forbids it).
        """
        done = 0
        while done < num_bytes:
            self._local.iov_base, self._local.iov_len = local_address + done, num_bytes - done
            self._remote.iov_base, self._remote.iov_len = remote_address + done, num_bytes - done
            n = self._fn(pid, self._local_p, 1, self._remote_p, 1, 0)
            if n <= 0:  # 0: nothing readable at the remote address (unmapped tail)
                err = ctypes.get_errno() if n < 0 else 14  # EFAULT
                raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
            done += n


    def pull(self, pid: int, remote_address: int, local_address: int, num_bytes: int, what: str) -> None:
        """:meth:`read` for a collective: ``what`` names it in the error.

        Raises:
            CommError: the read failed (the peer freed its input early, or CMA was revoked).
        """
        try:
            self.read(pid, remote_address, local_address, num_bytes)
        except OSError as e:
            raise CommError(f"single-copy read of {num_bytes} bytes by {what} (pid {pid}) failed: {e}; set "
                            "ShmBackend.Config.cma=False to use the rings") from e


class CmaProbe:
    """A random nonce in this process's private memory, for peers to read with :func:`probe_peer`."""

    def __init__(self):
        self.nonce = secrets.token_bytes(_NONCE_BYTES)
        self._buf = ctypes.create_string_buffer(self.nonce, _NONCE_BYTES)

    def describe(self) -> str:
        """``"<address>:<nonce hex>"``, the string peers pass to :func:`probe_peer`."""
        return f"{ctypes.addressof(self._buf)}:{self.nonce.hex()}"


def probe_peer(pid: int, description: str) -> str | None:
    """Read a peer's :class:`CmaProbe` nonce with ``process_vm_readv``.

    Args:
        pid: the peer's process id.
        description: the peer's :meth:`CmaProbe.describe`, or ``"off"`` (it cannot use CMA itself).

    Returns:
        ``None`` when the read returned the nonce (or the peer is "off": it reports its own
        reason), else the reason it cannot be used (one line).
    """
    if description == "off":
        return None
    address, nonce_hex = description.split(":")
    got = ctypes.create_string_buffer(_NONCE_BYTES)
    try:
        PeerReader().read(pid, int(address), ctypes.addressof(got), _NONCE_BYTES)
    except OSError as e:
        return f"process_vm_readv from pid {pid} failed: {e.strerror or e}"
    if got.raw != bytes.fromhex(nonce_hex):
        return f"process_vm_readv from pid {pid} returned other bytes than the peer wrote"
    return None


def start_probe(store, key: str, world_size: int,
                enabled: bool) -> tuple[PeerReader | None, CmaProbe | None, str | None]:
    """Publish this rank's probe nonce under ``key`` in ``store`` (``"off"`` when it cannot run).

    Returns:
        (reader, probe, reason): the reader and the probe (keep it alive until every peer has
        probed), or ``None``s and why single copy cannot run on this rank.
    """
    reader = probe = reason = None
    if world_size == 1:
        reason = "one rank: no peer to read from"
    elif not enabled:
        reason = "disabled (ShmBackend.Config.cma=False)"
    else:
        try:
            reader, probe = PeerReader(), CmaProbe()
        except OSError as e:
            reason = str(e)
    store.set(key, probe.describe() if probe is not None else "off")
    return reader, probe, reason


def agree(rank: int, world_size: int, local_reason: str | None, peers: dict[int, str]) -> tuple[bool, str | None]:
    """Single copy only if every rank read every peer: the same decision on every rank.

    Args:
        local_reason: why this rank cannot use it (``None``: it read every peer's nonce).
        peers: per other rank, what it published: ``"cma"`` or ``"copy:<reason>"``.

    Returns:
        (in use, the first refusal as ``"rank R: reason"`` or ``None``).
    """
    refusals = [f"rank {rank}: {local_reason}"] if local_reason else []
    refusals += [f"rank {p}: {v.split(':', 1)[-1]}" for p, v in sorted(peers.items()) if v != "cma"]
    if refusals and world_size > 1:
        logger.info("shm rank %d: single copy (process_vm_readv) off, rings in use: %s", rank, "; ".join(refusals))
    if world_size == 1:
        return False, local_reason
    return not refusals, (refusals[0] if refusals else None)
