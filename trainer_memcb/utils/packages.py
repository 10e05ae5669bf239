"""A package an asked-for feature needs and that is not installed: its own error, so that the
command line can tell it from a usage error (it exits 4, not 2) and name the extra to install."""

from __future__ import annotations

from typing import Optional

__all__ = ["MissingPackageError"]


class MissingPackageError(ImportError):
    """`feature` needs `package`, which is not installed; `extra` is the trainer_memcb extra that
    brings it (the message names `pip install "trainer_memcb[<extra>]"`).

    Args:
        feature: what was asked for, e.g. "LoRA adapters (--lora-r)".
        package: the import name that is missing, e.g. "peft".
        extra: the extra of setup.cfg that installs it, or None.
    """

    def __init__(self, feature: str, package: str, extra: Optional[str] = None) -> None:
        install = f'pip install "trainer_memcb[{extra}]"' if extra else f"pip install {package}"
        super().__init__(f"{feature} need the {package} package, not installed here: {install}", name=package)
        self.feature = feature
        self.package = package
        self.extra = extra
