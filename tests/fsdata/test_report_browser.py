"""The report as a person sees it: rendered by headless Chromium, the screenshot checked.

Needs Debian's ``chromium`` (``apt-get install -y chromium``; .ci/run installs it): skipped with that reason
otherwise, except in CI (``CI`` set), where a missing browser fails the test.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from fsdata.cli import main
from tests.fsdata.helpers import write_samples

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(html_path, png_path, profile_dir, width: int = 1300, height: int = 3000) -> np.ndarray:
    """Render ``html_path`` headless and return the screenshot as ``[H x W x 3]`` float in [0, 1]."""
    import matplotlib.image as mpimg

    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           f"--user-data-dir={profile_dir}", f"--screenshot={png_path}", f"--window-size={width},{height}",
           html_path.resolve().as_uri()]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    return mpimg.imread(str(png_path))[..., :3]


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                    reason="chromium is not installed (Debian: apt-get install -y chromium)")
def test_report_renders_in_chromium_with_its_figures(tmp_path):
    assert CHROMIUM, "chromium is not installed: .ci/run installs it (apt-get install -y chromium)"
    samples = write_samples(tmp_path / "s.parquet", n=700, id_offset=0)
    out = tmp_path / "out"
    assert main(["balance", str(samples), str(out), "--ranks", "4", "--batch-size-per-rank", "8", "--no-progress"]) == 0
    page = tmp_path / "report.html"
    assert main(["report", str(out), "--html", str(page)]) == 0
    html = page.read_text()
    assert len(re.findall(r"<img ", html)) == 4
    img = screenshot(page, tmp_path / "shot.png", tmp_path / "profile")
    assert img.std() > 0.05  # not blank
    nonwhite = (img < 0.95).any(axis=2).mean()
    saturated = (img.max(axis=2) - img.min(axis=2) > 0.25).mean()  # plot colours: text is grey
    # the same page without its images: text only
    bare = tmp_path / "bare.html"
    bare.write_text(re.sub(r"<img [^>]*>", "", html))
    txt = screenshot(bare, tmp_path / "bare.png", tmp_path / "profile2")
    assert nonwhite > 3 * (txt < 0.95).any(axis=2).mean()
    assert saturated > 0.01 and (txt.max(axis=2) - txt.min(axis=2) > 0.25).mean() < 0.001
