"""Reading finished runs without trusting them: `trainer_state.json`, checkpoints, event files and
the summary, each value checked before use. Used by the `trainer-memcb` command.
"""
