"""What the stand-in kernels of a trace ran (`trainer_memcb.plan.step.flash_attn`'s and
`trainer_memcb.plan.step.liger_kernels`'s): each kernel's calls, counted as the trace runs them, for
the plan's note."""

from __future__ import annotations

from typing import Dict, Optional

__all__ = ["KernelRuns"]


class KernelRuns:
    """Each stand-in kernel's calls in one trace; a subclass says the rest of its note (`note`)."""

    def __init__(self) -> None:
        self.calls: Dict[str, int] = {}

    def count(self, kernel: str) -> None:
        self.calls[kernel] = self.calls.get(kernel, 0) + 1

    def calls_text(self) -> str:
        """"name (N calls), ...", by name."""
        return ", ".join(f"{name} ({count} calls)" for name, count in sorted(self.calls.items()))

    def note(self) -> Optional[str]:
        """The plan's note naming the kernels planned; None where none ran."""
        raise NotImplementedError
