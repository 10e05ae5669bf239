"""The plan's answers: what one process holds, read from the traced step and the settings.

`model_states` lays the model states out over the processes (with `sharding`'s partition rules);
`eval_memory` plans the evaluation loop.
"""
