"""The actors: plain classes that rlray.orchestration.cluster wraps with `ray.remote` (so every one
can also be built in-process in a test). `trainer` (one FSDP2 rank: learner, state, weight
publisher), `rollout` (a vLLM engine, its OpenAI server and the env runner), `buffer` (groups in,
packed micro-batches out), and the rollout actor's parts: `engine` (the one vLLM adapter) and
`server` (vLLM's OpenAI server around it). May import types, config, algo, data, models, parallel,
weightsync and envs; never Ray.
"""
