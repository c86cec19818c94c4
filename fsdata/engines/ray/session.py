"""The Ray session of the Ray engine: join or start Ray once per run, collect task results (a task's
:class:`~fsdata.errors.FsdataError` re-raised as one clean line, the other tasks cancelled), and
leave no Ray process of ours running after the job.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from fsdata.errors import ConfigError, FsdataError

log = logging.getLogger("fsdata.engines.ray")


def import_ray():
    try:
        import ray  # noqa: PLC0415 (optional dependency)
    except ImportError:
        raise ConfigError("--engine ray needs Ray: pip install 'freescale[ray]' (or pip install 'ray[data]')") from None
    return ray



def node_id() -> str:
    """The Ray node this task runs on."""
    import ray  # noqa: PLC0415

    return ray.get_runtime_context().get_node_id()



def _unwrap(ray, fn):
    """Run ``fn``; a task that raised an :class:`FsdataError` re-raises that error (one clean line)."""
    try:
        return fn()
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, FsdataError):
            raise cause from None
        raise


def get(ray, refs: list) -> list:
    """``ray.get`` that cancels the other pending tasks when one fails."""
    try:
        return _unwrap(ray, lambda: ray.get(refs))
    except BaseException:
        for ref in refs:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
        raise


@contextlib.contextmanager
def ray_session(address: str | None = None, **init_kwargs) -> Iterator[object]:
    """Use the Ray instance this process already joined, else join ``address`` (or
    ``RAY_ADDRESS``), else start a local one; shut down only what this call started.

    Raises:
        ConfigError: Ray is not installed, or the cluster at ``address`` cannot be reached.
    """
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    # "local", not None: Ray's None also joins the last cluster started on this machine
    # (/tmp/ray/ray_current_cluster), which may be another user's or another job's.
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    before = {p.pid for p in _our_processes()}  # another instance's processes are not ours to end
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=False, configure_logging=True, **init_kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = "a local Ray instance" if address == "local" else address
        raise ConfigError(f"cannot start or join Ray at {where} ({str(e).splitlines()[0]}); start the cluster with "
                          "'ray start --head' and pass its address with --ray-address HOST:PORT") from None
    started = _our_processes(before)  # the raylet, GCS, agents and workers this call started
    try:
        yield ray
    finally:
        ray.shutdown()
        _end_leftovers(started, before)


def _our_processes(exclude: set[int] = frozenset()) -> list:
    """This process's Ray descendants (``psutil.Process``) whose pid is not in ``exclude``; empty
    when psutil is unavailable."""
    try:
        import psutil  # noqa: PLC0415 (a Ray dependency)

        out = []
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if p.pid not in exclude and ("ray" in " ".join(p.cmdline()).lower() or "ray" in p.name().lower()):
                    out.append(p)
        return out
    except Exception:  # noqa: BLE001
        return []


def _end_leftovers(procs: list, before: set[int] = frozenset(), grace_s: float = 5.0) -> None:
    """After ``ray.shutdown()``: wait for the Ray processes this run started (``procs``, and any
    Ray descendant started since, i.e. not in ``before``), end any still running (SIGTERM, then
    SIGKILL), and log which; nothing of ours is left running after the job, and nothing of another
    Ray instance of this process is touched."""
    if not procs:
        return
    import psutil  # noqa: PLC0415

    procs = [p for p in procs + _our_processes(before) if p.is_running()]
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            log.warning("ending Ray process %d (%s) left after ray.shutdown()", p.pid, p.name())
            p.terminate()
    _, alive = psutil.wait_procs(alive, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()

