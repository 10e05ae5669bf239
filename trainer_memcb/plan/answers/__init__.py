"""The plan's answers, read from the traced step's products and the settings, never from the trace.

`step_memory`: one training step's peak, its phase and parts, the model states during the step and
fits? (`plan_step_memory`, `states_during_step`); `max_batch`: the largest batch that fits;
`model_states`: the model states laid out over the processes (with `sharding`'s partition rules);
`eval_memory`: the evaluation loop's forward and containers.
"""
