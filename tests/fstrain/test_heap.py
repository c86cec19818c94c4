"""fstrain's glibc heap settings (fstrain/components/heap.py): the step's tensors come from the heap
(a fixed 32 MiB mmap threshold, no dynamic adjustment), and ``malloc_trim`` every few steps hands
the heap's free pages back however fragmented it is. Each probe runs in a fresh process (glibc's
settings are per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator (Linux)")

_HEADER = """
import ctypes, json, os, sys
sys.path.insert(0, {root!r})
libc = ctypes.CDLL("libc.so.6")
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
from fstrain.components.heap import HeapTrimmer, configure_heap
configured = configure_heap() if {configure} else False
def mmapped(size):
    before = libc.mallinfo2().hblks
    p = libc.malloc(size)
    n = libc.mallinfo2().hblks - before
    libc.free(p)
    return n
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
"""

_THRESHOLD = _HEADER + """
print(json.dumps({{"configured": configured, "16MiB": mmapped(16 << 20), "48MiB": mmapped(48 << 20)}}))
"""

_TRIM = _HEADER + """
blocks, pins = [], []
for _ in range(300):                             # 1 MiB blocks, each pinned in place by a small live one
    p = libc.malloc(1 << 20); ctypes.memset(p, 1, 1 << 20); blocks.append(p)
    pins.append(libc.malloc(64))
for p in blocks:
    libc.free(p)
freed = rss()
t = HeapTrimmer(every_steps=5)
t.step(4)
not_yet = rss()
t.step(5)
print(json.dumps({{"configured": configured, "freed": freed, "not_yet": not_yet, "trimmed": rss(), "trims": t.trims}}))
"""


def _probe(code: str, configure: bool, **env_extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(env_extra)
    r = subprocess.run([sys.executable, "-c", code.format(root=str(REPO_ROOT), configure=configure)],
                       capture_output=True, text=True, env=env)
    if r.returncode and "mallinfo2" in r.stderr:  # glibc < 2.33 or musl
        pytest.skip(f"glibc mallinfo2 unavailable: {r.stderr.strip().splitlines()[-1:]}")
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_blocks_below_32_mib_come_from_the_heap():
    plain = _probe(_THRESHOLD, False)
    assert plain == {"configured": False, "16MiB": 1, "48MiB": 1}  # glibc starts at 128 KiB
    fixed = _probe(_THRESHOLD, True)
    assert fixed == {"configured": True, "16MiB": 0, "48MiB": 1}


def test_the_trimmer_hands_fragmented_free_pages_back_every_n_steps():
    r = _probe(_TRIM, True)
    assert r["configured"] is True and r["trims"] == 1
    assert r["freed"] - r["not_yet"] < (50 << 20), r  # step 4: no trim, the freed 300 MiB stay resident
    assert r["freed"] - r["trimmed"] > (200 << 20), r  # step 5: trimmed


def test_without_configure_the_trimmer_does_nothing():
    r = _probe(_TRIM, False)
    assert r["configured"] is False and r["trims"] == 0
    assert r["freed"] - r["trimmed"] < (50 << 20), r


@pytest.mark.parametrize("var", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"])
def test_the_users_setting_wins(var):
    r = _probe(_THRESHOLD, True, **{var: "131072"})
    assert r["configured"] is False
