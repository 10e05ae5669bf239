"""What runs during training: the Trainer callback, the custom-loop logger, and what they log.

`callback` and `accelerate_loop` are the public glue; the callback composes `callback_measuring`,
`callback_logging`, `callback_hooks` (the hooks on the Trainer's methods, one installer) and
`callback_preflight`; `monitor` measures on logged steps,
`model_states_probe` the four model states, `figures` names the keys, and `summary`,
`tensorboard_view` and `trainer_log_hook` put them where the Trainer's logs go.
"""
