"""The HTML page writer shared by ``fsdata report`` and ``fstrain report``: one self-contained page
(tables and base64 PNG figures, no network at view time) written with its PNGs beside it, each file
atomically, replacing only files this writer made (:data:`fsdata.atomic.HTML_MARKER`, PNG
``Software: freescale-report``) unless told to overwrite. matplotlib (Agg) is imported on first use.
"""

from __future__ import annotations

import base64
import html
import io
import os
from dataclasses import dataclass
from pathlib import Path

from fsdata.atomic import HTML_MARKER, check_regenerable
from fsdata.errors import InputError


def pyplot():
    """``matplotlib.pyplot`` with the Agg backend (no display needed), imported on first use."""
    import matplotlib  # noqa: PLC0415 (plotting only when a report is made)

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


@dataclass(kw_only=True, slots=True)
class Figure:
    """One figure of a report: a PNG and its caption.

    Attributes:
        name: file stem of the PNG (``<html stem>-<name>.png``).
        title: heading on the page.
        caption: one or two sentences under the image.
        png: the PNG bytes.
    """

    name: str
    title: str
    caption: str
    png: bytes


def figure_png(fig) -> bytes:
    """Render a matplotlib figure to PNG bytes (100 dpi) and close it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": "freescale-report"})
    pyplot().close(fig)
    return buf.getvalue()


_CSS = ("body{font-family:sans-serif;max-width:1250px;margin:24px auto;color:#222;padding:0 16px}"
        "table{border-collapse:collapse;margin:8px 0 20px}td,th{border:1px solid #ccc;padding:4px 10px;text-align:left}"
        "th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}figure{margin:0 0 28px}"
        "figcaption{color:#555;font-size:90%;max-width:1100px}")


def html_page(title: str, sections: list[tuple[str, list[tuple[str, str]], list[Figure]]]) -> str:
    """A self-contained HTML page: per section a heading, a table and figures (base64 PNG).

    Args:
        title: page title.
        sections: ``(heading, table rows (name, value), figures)``.

    Returns:
        The HTML text (no external resources).
    """
    parts = [f"<!doctype html><html><head><meta charset='utf-8'>{HTML_MARKER}<title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    for heading, rows, figs in sections:
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        if rows:
            parts.append("<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                                            for k, v in rows) + "</table>")
        for f in figs:
            b64 = base64.b64encode(f.png).decode("ascii")
            parts.append(f"<figure id='{f.name}'><h3>{html.escape(f.title)}</h3>"
                         f"<img alt='{html.escape(f.title)}' src='data:image/png;base64,{b64}'>"
                         f"<figcaption>{html.escape(f.caption)}</figcaption></figure>")
    parts.append("</body></html>\n")
    return "".join(parts)


def _atomic_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_page(html_path: str | os.PathLike, title: str,
               sections: list[tuple[str, list[tuple[str, str]], list[Figure]]], *, overwrite: bool = False) -> dict:
    """Write the HTML page and one PNG per figure (``<stem>-<figure name>.png`` beside it).

    Every file is written to a temporary name and renamed into place. A page or figure this
    command wrote before (it carries :data:`fsdata.atomic.HTML_MARKER` / PNG ``Software
    freescale-report``) is replaced; any other file only with ``overwrite``; a folder, or a path
    inside an ``fsdata balance`` OUTPUT, never (:func:`fsdata.atomic.check_regenerable`).

    Returns:
        ``{"html": path, "png": [paths]}``.

    Raises:
        InputError: the folder of ``html_path`` does not exist. ConfigError: a path is taken (above).
    """
    hp = Path(html_path)
    if not hp.parent.is_dir():
        raise InputError(f"folder {hp.parent} of --html {hp} does not exist; create it or choose another path")
    pngs = [(hp.with_name(f"{hp.stem}-{f.name}.png"), f) for _, _, figs in sections for f in figs]
    for p, kind in [(hp, "report"), *((p, "report-figure") for p, _ in pngs)]:  # all before anything is written
        check_regenerable(p, kind, overwrite=overwrite, name="--html" if p == hp else "figure")
    for p, f in pngs:
        _atomic_bytes(p, f.png)
    _atomic_bytes(hp, html_page(title, sections).encode())
    return {"html": str(hp), "png": [str(p) for p, _ in pngs]}
