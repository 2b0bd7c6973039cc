"""How NeMo Gym's launcher hands a server its config: the two environment variables it
sets for each server process, which the proxy reads (a server under the launcher) and
passes on to its workers (`worker.nemo_gym_server`, which builds the app from them).

Here, on the floor, because both the proxy's configuration and the workers read them.
"""

from __future__ import annotations

__all__ = ["CONFIG_DICT_ENV", "CONFIG_PATH_ENV"]

CONFIG_DICT_ENV = "NEMO_GYM_CONFIG_DICT"  # the whole global config, as YAML or JSON
CONFIG_PATH_ENV = "NEMO_GYM_CONFIG_PATH"  # the server's instance (its key in the config)
