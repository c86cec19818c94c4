"""pytest plugin of the GPU check: a test that needs a package the GPU image lacks is skipped, not failed.

The lent GPU image has torch, pyarrow, numba and pytest but no torchrec, fbgemm-gpu, polars or
ortools (:data:`MISSING_OK`). Loaded with ``-p benchmarks.gpu_tests_plugin``:

* a test module whose import fails with ``No module named '<one of them>'`` is reported as
  skipped (``needs torchrec``) instead of a collection error;
* a test that fails because one of them is missing (its failure text says ``No module named
  '<one of them>'``, also when a worker process it started failed that way) is reported as
  skipped the same way.

Any other failure stays a failure.
"""

from __future__ import annotations

import re

import pytest

MISSING_OK = ("torchrec", "fbgemm_gpu", "polars", "ortools")
_NO_MODULE = re.compile(r"No module named '([A-Za-z0-9_]+)")


def missing_package(text: str) -> str | None:
    """The package of :data:`MISSING_OK` that ``text`` (an error's text) says is missing, or ``None``."""
    for name in _NO_MODULE.findall(text or ""):
        if name.split(".")[0] in MISSING_OK:
            return name.split(".")[0]
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        name = missing_package(str(report.longrepr))
        if name:
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), 0, f"needs {name} (not on this image)")
            report.result = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None:
        name = missing_package(f"{call.excinfo.value}\n{report.longrepr}")
        if name:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, f"needs {name} (not on this image)")
