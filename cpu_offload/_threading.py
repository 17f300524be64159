"""Pick Numba's threading layer before Numba is imported (imported first by cpu_offload/__init__ and kernels).

On 2 vCPUs the default layer (OpenMP) spins for milliseconds per parallel call; ``workqueue`` does not. An explicit
``NUMBA_THREADING_LAYER`` in the environment wins. The layer is fixed at Numba's first parallel launch, so if Numba
was imported earlier we set ``numba.config.THREADING_LAYER`` directly, which still works as long as nothing has
launched a parallel Numba function yet. (Both cpu_offload/__init__ and kernels.py import this module, because a
stale editable install can expose cpu_offload as a namespace package whose __init__ never runs.)
"""
import os
import sys

LAYER = os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

if "numba" in sys.modules and hasattr(sys.modules["numba"], "config"):
    sys.modules["numba"].config.THREADING_LAYER = LAYER
