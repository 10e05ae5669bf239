"""What runs during training: the Trainer callback, the custom-loop logger, and what they log.

`callback` and `accelerate_loop` are the public glue; `monitor` measures on logged steps,
`model_states_probe` the four model states, `figures` names the keys, and `summary`,
`tensorboard_view` and `trainer_log_hook` put them where the Trainer's logs go.
"""
