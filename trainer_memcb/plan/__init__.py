"""Planning before training: the optimizer what-if and the model states per process.

Builds the Trainer's optimizers over meta-device stand-ins (`whatif`, `trainer_optimizers`,
`stand_ins`, `lora`, `optim_options`) and lays the model states out over processes
(`model_states`, `sharding`). Imports only `state` and `utils` from the package.
"""
