"""Which fbgemm release belongs to which torch release, checked before torchrec loads fbgemm.

fbgemm_gpu wheels (``fbgemm-gpu`` for CUDA, ``fbgemm-gpu-cpu``) are built against one torch
release each but declare no torch requirement, so pip installs any pair; a wrong pair fails only
when torchrec loads fbgemm's libraries (``OSError: Could not load this library: ...
fbgemm_gpu_tbe_index_select.so``, an undefined torch symbol). ``pyproject.toml``'s ``[train-cpu]``
and ``[train-cuda]`` extras pin the pair of :data:`FBGEMM_FOR_TORCH`; :func:`check_fbgemm_matches_torch`
turns a wrong pair installed by other means into one line naming the fix.
"""

from __future__ import annotations

from importlib import metadata

#: torch release line -> the fbgemm release line built against it (FBGEMM's release notes; each row
#: is installed and imported together by tests/test_install.py). fbgemm 1.9 is built for a later torch:
#: next to torch 2.13 it fails to load.
FBGEMM_FOR_TORCH: dict[str, str] = {"2.13": "1.8"}

#: The distributions that ship the ``fbgemm_gpu`` module.
FBGEMM_DISTRIBUTIONS = ("fbgemm-gpu-cpu", "fbgemm-gpu")


def release_line(version: str) -> str:
    """``"2.13.0+cpu"`` -> ``"2.13"`` (major.minor, local label and patch dropped)."""
    return ".".join(version.split("+", 1)[0].split(".")[:2])


def installed_pair() -> tuple[str | None, list[tuple[str, str]]]:
    """The installed torch version (None if absent) and every installed (fbgemm distribution, version)."""
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    found = [(d, v) for d in FBGEMM_DISTRIBUTIONS if (v := version(d)) is not None]
    return version("torch"), found


def check_fbgemm_matches_torch() -> None:
    """Raise ImportError naming the fix when the installed fbgemm was built for another torch.

    Only torch lines in :data:`FBGEMM_FOR_TORCH` are checked; an fbgemm built from source under
    another distribution name is not seen, and passes.

    Raises:
        ImportError: e.g. ``fbgemm-gpu-cpu 1.9.0 is not built for torch 2.13.0+cpu ...``.
    """
    torch_version, fbgemm = installed_pair()
    if torch_version is None or release_line(torch_version) not in FBGEMM_FOR_TORCH:
        return
    want = FBGEMM_FOR_TORCH[release_line(torch_version)]
    for dist, v in fbgemm:
        if release_line(v) != want:
            extra = "train-cpu" if dist == "fbgemm-gpu-cpu" else "train-cuda"
            raise ImportError(f"{dist} {v} is not built for torch {torch_version} (torch "
                              f"{release_line(torch_version)} needs {dist} {want}.*); install the pair with "
                              f"pip install '{dist}=={want}.*' or pip install 'freescale[{extra}]' (docs/api.md)")
