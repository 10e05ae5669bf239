"""The built-in estimate rules, one module per library. Importing this package registers them.

Rules for optional libraries (transformers' own optimizers, bitsandbytes, torchao, GaLore, APOLLO,
LOMO, GrokAdamW, schedule-free, torch-optimi) are registered by `"module:ClassName"` and resolved
only once the user has imported that library.
"""

from trainer_memcb.state.rules import apollo_optim  # noqa: F401
from trainer_memcb.state.rules import bitsandbytes_optim  # noqa: F401
from trainer_memcb.state.rules import deepspeed_zero  # noqa: F401
from trainer_memcb.state.rules import galore_optim  # noqa: F401
from trainer_memcb.state.rules import grokadamw_optim  # noqa: F401
from trainer_memcb.state.rules import lomo_optim  # noqa: F401
from trainer_memcb.state.rules import optimi_optim  # noqa: F401
from trainer_memcb.state.rules import schedulefree_optim  # noqa: F401
from trainer_memcb.state.rules import torch_optim  # noqa: F401
from trainer_memcb.state.rules import torchao_optim  # noqa: F401
from trainer_memcb.state.rules import transformers_optim  # noqa: F401
