"""fstrain: a lean torchrec runtime that trains on fsdata's pre-balanced shards."""

import logging

__version__ = "0.2.0"


class _KnownLibraryNoise(logging.Filter):
    """Drops log lines that libraries emit on every run and that no fstrain user can act on.

    Only exact, known messages are dropped; every other record of these loggers (and every
    warning of fstrain's own) passes.
    """

    #: logger name -> message prefixes to drop.
    KNOWN = {
        # torchrec's KeyedJaggedTensor calls torch.fx's is_fx_tracing(), which logs this on the first
        # batch of every process (torch 2.13); the call is torchrec's, not ours or the user's.
        "torch.fx._symbolic_trace": ("is_fx_tracing will return true for both fx.symbolic_trace and torch.export",),
    }

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


for _name, _prefixes in _KnownLibraryNoise.KNOWN.items():
    logging.getLogger(_name).addFilter(_KnownLibraryNoise(_prefixes))

# A wrong torch/fbgemm pair fails deep inside torchrec with an undefined-symbol OSError: name it here.
from fstrain.compat import check_fbgemm_matches_torch as _check_fbgemm  # noqa: E402

_check_fbgemm()
