"""The built-in estimate rules, one module per library. Importing this package registers them.

Rules for optional libraries (bitsandbytes, torchao) are registered by `"module:ClassName"` and
resolved only once the user has imported that library.
"""

from trainer_memcb.rules import torch_optim  # noqa: F401
