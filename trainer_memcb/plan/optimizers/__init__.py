"""The optimizer as the Trainer builds it, over the prepared model's stand-ins.

`trainer_optimizers` builds the Trainer's optimizer for an `optim` name; `update_kinds` says which
optimizers update inside backward and which setups the plan covers for them; `whatif` compares
the optimizers' states over a model built from its config.
"""
