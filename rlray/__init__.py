"""rlray: asynchronous RL post-training for LLMs on Ray."""
