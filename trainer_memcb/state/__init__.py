"""The framework-free core: what an optimizer's state holds, what it should hold, and the judgement.

`measure` reads what the state really holds, `registry` and `rules/` say what each optimizer family
should hold, `estimate` applies them, and `judge` explains any difference. Nothing here imports
transformers, accelerate or the layers above (`plan`, `training`, `runs`, `cli`).
"""

# Registers the built-in estimate rules (each rule module registers itself with `registry`), so that
# every lookup sees them whichever module of this layer was imported first.
from trainer_memcb.state import rules as _builtin_rules  # noqa: E402,F401
