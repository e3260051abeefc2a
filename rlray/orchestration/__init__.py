"""Everything that knows Ray: `cluster` (the only module that knows Ray resources: placement
groups, spawning the actors, the code shipped to every node), `fleet` (the rollout pool: weight
syncs, health, replacement), `controller` (the stages and the step loop), `plan` (placement and
memory, computed before any actor starts), `checkpoint` (committed checkpoint folders) and
`metrics` (metrics.jsonl, wandb, Ray gauges). May import every package below it.
"""
