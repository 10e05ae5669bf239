"""`optim_args` and `optim_target_modules`, spelled as `TrainingArguments` takes them, checked early.

The Trainer reads `optim_args` as `"key=value,key=value"` (spaces dropped) and passes each value to
the optimizer's handler, which converts it; a piece without `=` fails deep inside the Trainer. Here
it fails at once, with a ValueError naming the piece.

`optim_target_modules` is either one string, which the Trainer matches against each whole module
name with `re.fullmatch` (or `"all-linear"`), or a list, each entry of which matches a module
whose name is it, contains it, or fully matches it as a regular expression
(`transformers.trainer_utils.check_target_module_exists`). A comma in the text makes it a list.
"""

from __future__ import annotations

import re
from typing import Any, List, Mapping, Optional, Union

__all__ = ["parse_optim_args", "parse_optim_target_modules", "parse_target_modules"]

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_EXAMPLE_ARGS = '"rank=64,update_proj_gap=200"'
_EXAMPLE_TARGETS = "'.*(attn|mlp).*' (one regular expression, matched against whole module names) or attn,mlp"


def parse_optim_args(optim_args: Union[None, str, Mapping[str, Any]]) -> Optional[str]:
    """Check `optim_args` and return it as the Trainer's string, or None when empty.

    Args:
        optim_args: `"rank=64, update_proj_gap=200"`, or a mapping `{"rank": 64}`, or None.

    Raises:
        ValueError: a piece that is not `key=value`, naming it.

    Examples:
        >>> from trainer_memcb.plan.settings.optim_options import parse_optim_args
        >>> parse_optim_args("rank=64, update_proj_gap=200")
        'rank=64,update_proj_gap=200'
        >>> parse_optim_args({"rank": 64, "proj_type": "left"})
        'rank=64,proj_type=left'
    """
    if optim_args is None:
        return None
    if isinstance(optim_args, Mapping):
        pieces = [f"{key}={value}" for key, value in optim_args.items()]
    elif isinstance(optim_args, str):
        pieces = optim_args.replace(" ", "").split(",")
    else:
        raise ValueError(f"optim_args={optim_args!r}: expected a string like {_EXAMPLE_ARGS} or a dict")
    checked = []
    for piece in pieces:
        piece = piece.replace(" ", "")
        if not piece:
            continue
        key, equals, value = piece.partition("=")
        if not equals or not _KEY.fullmatch(key) or not value or "=" in value:
            raise ValueError(f"optim_args piece {piece!r} is not key=value; write them like {_EXAMPLE_ARGS}")
        checked.append(f"{key}={value}")
    return ",".join(checked) or None


def _check_pattern(pattern: str, option: str) -> str:
    if not pattern:
        raise ValueError(f"{option} has an empty entry; write {_EXAMPLE_TARGETS}")
    try:
        re.compile(pattern)
    except re.error as error:
        raise ValueError(f"{option} entry {pattern!r} is not a regular expression ({error}); "
                         f"write {_EXAMPLE_TARGETS}") from None
    return pattern


def parse_target_modules(targets: Union[None, str, List[str], tuple],
                         option: str = "optim_target_modules") -> Union[None, str, List[str]]:
    """Check a module selection spelled as `TrainingArguments.optim_target_modules` and PEFT's
    `LoraConfig.target_modules` take it: one string is a regular expression, a comma makes a list.

    Args:
        targets: one regular expression (`".*(attn|mlp).*"`, `"all-linear"`), a comma list
            (`"attn,mlp"`, which becomes `["attn", "mlp"]`), a list, or None.
        option: the option's name, for the error message.

    Raises:
        ValueError: an empty entry or one that is not a regular expression, naming it.

    Examples:
        >>> from trainer_memcb.plan.settings.optim_options import parse_target_modules
        >>> parse_target_modules("attn, mlp")
        ['attn', 'mlp']
        >>> parse_target_modules(".*(q|v)_proj")
        '.*(q|v)_proj'
    """
    if targets is None:
        return None
    if isinstance(targets, str):
        if "," not in targets:
            return _check_pattern(targets.strip(), option)
        targets = targets.split(",")
    if not isinstance(targets, (list, tuple)) or not all(isinstance(entry, str) for entry in targets):
        raise ValueError(f"{option}={targets!r}: expected a string or a list of strings; write {_EXAMPLE_TARGETS}")
    entries = [_check_pattern(entry.strip(), option) for entry in targets]
    if not entries:
        raise ValueError(f"{option} is an empty list; write {_EXAMPLE_TARGETS}")
    return entries


def parse_optim_target_modules(targets: Union[None, str, List[str], tuple]) -> Union[None, str, List[str]]:
    """`parse_target_modules` for `TrainingArguments.optim_target_modules` (GaLore, APOLLO).

    Examples:
        >>> from trainer_memcb.plan.settings.optim_options import parse_optim_target_modules
        >>> parse_optim_target_modules(".*(attn|mlp).*")
        '.*(attn|mlp).*'
    """
    return parse_target_modules(targets, "optim_target_modules")
