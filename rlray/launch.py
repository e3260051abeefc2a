"""Hydra entry point: `python -m rlray.launch [+recipe=NAME] [key=value ...]`.

Contract: composes `conf/config.yaml` with the recipe and overrides, validates the
result into a typed `Config` (exiting 1 with one line naming the bad key, before Ray
starts), then hands it to the controller. Works from any working directory and
under `ray job submit`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from rlray.config import ConfigError, register, to_config

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")

register()


@hydra.main(config_path=CONF_DIR, config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        config = to_config(cfg)
        from rlray.algo.loss import check_algo

        check_algo(config.algo)
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(1)
    from rlray.controller import run

    run(config)


if __name__ == "__main__":
    main()
