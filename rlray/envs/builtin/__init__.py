"""The built-in environments: every module in this folder is one, its file name its `env.id`.

Contract: each module defines verifiers' `load_environment(**args)` (and may take `num_train`,
`num_eval`, `seed`), builds its prompts from characters the tiny models' tokenizer knows
(rlray.data.tokenizer.CHARS; tests/unit/test_envs.py checks every one), and is found by
`BUILTIN`, the sorted module names of this folder: adding a built-in environment is one file here
plus its test. rlray.envs.load_env loads `rlray.envs.builtin.<id>` for these ids.
"""

import pkgutil
from pathlib import Path

BUILTIN = tuple(sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])))
