"""fstrain: a lean torchrec runtime that trains on fsdata's pre-balanced shards."""

from fstrain.quiet import silence_import_noise as _silence_import_noise

__version__ = "0.3.0"

_silence_import_noise()  # torch.fx's tracing notice on the first batch (fstrain.quiet)

# A wrong torch/fbgemm pair fails deep inside torchrec with an undefined-symbol OSError: name it here.
from fstrain.compat import check_fbgemm_matches_torch as _check_fbgemm  # noqa: E402

_check_fbgemm()
