"""The garbage collector in the `trainer-memcb` process: no full pass over the modules it imports.

Importing torch and transformers makes hundreds of thousands of objects that live as long as the
process, and the collector's full passes walk all of them again and again: about 0.6 s of CPU in a
70B step plan (seven passes while the modules load), for a few dozen objects freed. So in the
command's own process the collector is paused from the package's first import until the command
is parsed (for a step plan: until its model is built and its model states planned, just before the
traces, `estimate_step`, as that imports transformers' modeling modules), and what exists then is frozen (`gc.freeze`: kept out of every later pass, as it lives
to the end anyway); the collector then runs as usual over what the command makes. Python code that
imports `trainer_memcb.cli` keeps its collector as it is.
"""

from __future__ import annotations

import gc

from trainer_memcb.cli.interrupt import this_process_is_the_command

__all__ = ["pause_while_importing", "freeze_what_was_imported"]

_paused = [False]


def pause_while_importing() -> bool:
    """In the command's own process, pause the collector (elsewhere do nothing); returns whether it did."""
    if not this_process_is_the_command() or not gc.isenabled():
        return False
    gc.disable()
    _paused[0] = True
    return True


def freeze_what_was_imported() -> None:
    """After `pause_while_importing`: freeze every object alive now and resume the collector."""
    if not _paused[0]:
        return
    _paused[0] = False
    gc.freeze()
    gc.enable()
