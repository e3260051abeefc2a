"""The built-in verifiers v1 (0.4) environments: every module here is one, its file name its `env.id`.

Contract: each module is a verifiers v1 taskset module (its `__all__` names one `Taskset` subclass and
may name one `Env` subclass), imported by verifiers' own loader as a top-level module (the v1 env actor
puts this folder on `sys.path`), so only the v1 interpreter imports them. A taskset config with a `split`
field gets `split: eval` for the eval split. `BUILTIN_V1` (rlray.envs.v1) lists them.
"""
