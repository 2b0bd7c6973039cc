"""gym-proxy's settings in a NeMo Gym server's own config block (the `gym_proxy:` key).

NeMo Gym's launcher starts a server as `python <entrypoint>` with the entrypoint as one
word, so `-mgym_proxy --session-state X` cannot be written there; what gym-proxy needs
comes from the block that already describes the server:

    counter:
      resources_servers:
        example_session_state_mgmt:
          entrypoint: -mgym_proxy
          num_workers: 4                 # NeMo Gym's own key: gym-proxy's worker count
          gym_proxy:                     # any gym-proxy option, named as its flag
            session_state: session_id_to_counter
            secret_file: /run/gym-secret

NeMo Gym's config model keeps unknown keys of a server block (`BaseRunServerTypeConfig`
allows extras), and gym-proxy takes the key out of the config its workers get, so a
server class whose config forbids extras never sees it.

Precedence: a command-line flag, then this block, then gym-proxy's environment
variables, then the NeMo Gym instance's host, port and `num_workers`, then defaults.
Some options cannot be set here, each for a reason `_REFUSED` gives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

from gym_proxy.proxy.config import Config, ConfigError, read_secret_file

__all__ = ["apply_block"]


_REFUSED = {
    "app": "the launcher runs the server's own app.py",
    "app_dir": "the launcher runs the server from its own directory",
    "nemo_gym_config": "this block is part of the NeMo Gym config already",
    "name": "the instance is the block's own",
    "host": "set the server's own `host`",
    "port": "set the server's own `port`",
    "fd": "a descriptor cannot be handed down by a config file",
    "workers": "set the server's own `num_workers`",
    "secret": "the config reaches every server of the stack: use `secret_file`",
    "control_token": "the config reaches every server of the stack: use `control_token_file`",
}


def apply_block(config: Config, block: Any, where: str) -> Config:
    """`config` with the block's settings for every option no flag set; `where` names the
    block in errors (`<instance>.<type>.<server>.gym_proxy`)."""
    if block is None:
        return config
    if not isinstance(block, Mapping):
        raise ConfigError(f"{where} must be a mapping of gym-proxy options, got {block!r}")
    options = {item.name: item for item in fields(Config) if not item.metadata.get("internal")}
    from_flags = config.given - config.from_env
    values: dict[str, Any] = {}
    for key, raw in block.items():
        name = str(key).replace("-", "_")
        if name in _REFUSED:
            raise ConfigError(f"{where}.{key} cannot be set here: {_REFUSED[name]}")
        item = options.get(name)
        if item is None:
            raise ConfigError(f"{where}.{key} is not a gym-proxy option (see docs/cli.md)")
        if name in from_flags or name.removesuffix("_file") in from_flags:
            continue  # a flag wins (`--secret` over the block's `secret_file` too)
        values[name] = _value(item.metadata, raw, f"{where}.{key}")
    for secret in ("secret", "control_token"):
        path = values.get(f"{secret}_file")
        if path is not None:  # read now, as for the flag; over the environment's value
            values[secret] = read_secret_file(path, f"{where}.{secret}_file")
    # Settled again: the block may bring the secret, or the grace itself.
    config = replace(config, **values, given=config.given | frozenset(values))
    return config.settle_workers().settle_orphan_grace()


def _value(meta: Mapping[str, Any], raw: Any, where: str) -> Any:
    """The YAML value as the option's type: a number for a number, true/false for a
    switch, text for text; never a guess from a value of another kind."""
    kind = meta["type"]
    if meta["flag"] or kind is bool:
        if not isinstance(raw, bool):
            raise ConfigError(f"{where} must be true or false, got {raw!r}")
        return raw
    if kind in (int, float):
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise ConfigError(f"{where} must be a number, got {raw!r}")
        if kind is int and isinstance(raw, float) and not raw.is_integer():  # .inf, .nan too
            raise ConfigError(f"{where} must be a whole number, got {raw!r}")
        return kind(raw)
    if isinstance(raw, bool) or not isinstance(raw, str | int):
        raise ConfigError(f"{where} must be text, got {raw!r}")
    value = str(raw)
    if meta["choices"] and value not in meta["choices"]:
        raise ConfigError(f"{where} must be one of {', '.join(meta['choices'])}, got {value!r}")
    return kind(value)
