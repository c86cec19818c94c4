"""fstrain fixes glibc's mmap threshold: after a large block is freed, a block of a few MiB is
still served by ``mmap`` (so freeing it returns the memory), where glibc's dynamic threshold would
have moved it to the fragmenting heap."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

_PROBE = """
import ctypes, json, sys
sys.path.insert(0, {root!r})
libc = ctypes.CDLL("libc.so.6")
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
fixed = False
if {fix}:
    from fstrain.components.heap import fix_mmap_threshold
    fixed = fix_mmap_threshold()
big = libc.malloc(16 << 20); libc.free(big)      # raises glibc's dynamic threshold to 16 MiB
before = libc.mallinfo2().hblks
p = libc.malloc(2 << 20)
after = libc.mallinfo2().hblks
libc.free(p)
print(json.dumps({{"fixed": fixed, "mmapped": after - before}}))
"""


def _probe(fix: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    r = subprocess.run([sys.executable, "-c", _PROBE.format(root=str(REPO_ROOT), fix=fix)], capture_output=True,
                       text=True, env=env, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator (Linux)")
def test_a_few_mib_stay_mmapped_after_a_large_free():
    try:
        plain = _probe(False)
    except subprocess.CalledProcessError as e:  # no mallinfo2 (glibc < 2.33, musl)
        pytest.skip(f"glibc mallinfo2 unavailable: {e.stderr.strip().splitlines()[-1:]}")
    assert plain["mmapped"] == 0  # glibc's dynamic threshold: 2 MiB now come from the heap
    fixed = _probe(True)
    assert fixed["fixed"] is True and fixed["mmapped"] == 1


def test_the_users_setting_wins(monkeypatch):
    from fstrain.components.heap import fix_mmap_threshold

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert fix_mmap_threshold() is False
