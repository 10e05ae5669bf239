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

__all__ = ["pause_while_importing", "freeze_what_was_imported", "freeze_what_the_plan_keeps"]

_paused = [False]
_froze = [False]  # whether `freeze_what_was_imported` froze the command's objects


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
    _froze[0] = True
    gc.freeze()
    gc.enable()


def freeze_what_the_plan_keeps() -> None:
    """After a step plan in the command's own process (once `freeze_what_was_imported` froze what
    it imported): freeze every object alive now; elsewhere do nothing.

    --fit plans up to a dozen steps, and what each plan leaves (its plan, its timeline, the traces
    kept for the next proposals, the fake-tensor cache) lives to the end of the search. Unfrozen,
    each full pass of the collector walks all of it again: on Llama-2-7B at 8 x 2048, about 20
    passes of 0.05 to 0.2 s each (one after each trace, the others as the objects pile up). The
    trace has just collected its own garbage (`trace_step_once`), so what is frozen is what the
    plan keeps; an object that dies later is still freed by its reference count."""
    if _froze[0]:
        gc.freeze()
