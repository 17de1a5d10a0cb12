"""Environment switches: read once per apply(), validated strictly so a typo never silently changes behaviour."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MASTER_SWITCH = "TRL_VLM_FIXES"
STRICT_SWITCH = "TRL_VLM_FIXES_STRICT"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
ACCEPTED_VALUES = "1/0, true/false, yes/no, on/off (any case)"


class SwitchValueError(ValueError):
    """A trl_vlm_fixes environment variable holds a value we do not understand."""


def fix_switch(fix_name: str) -> str:
    """The variable that turns one fix off, e.g. ``TRL_VLM_FIXES_MM_REALIGN``."""
    return f"{MASTER_SWITCH}_{fix_name.upper()}"


def read_bool(variable: str, default: bool) -> bool:
    """Parse a boolean switch; unknown values raise instead of guessing."""
    raw = os.environ.get(variable)
    if raw is None or raw.strip() == "":
        return default
    return _parse_bool(variable, raw)


def master_switch() -> bool:
    return read_bool(MASTER_SWITCH, True)


def own_switch(fix_name: str) -> bool:
    """A fix's own on/off switch (``TRL_VLM_FIXES_<NAME>``); one that is not on/off is the fix's ``switch_setting``."""
    return read_bool(fix_switch(fix_name), True)


def fix_enabled(fix_name: str) -> bool:
    """A fix runs unless the master switch or its own switch turns it off (both are validated)."""
    return master_switch() and own_switch(fix_name)


def strict_mode() -> bool:
    return read_bool(STRICT_SWITCH, False)


def validate_environment(fix_names: list[str]) -> None:
    """Fail at import time on any malformed switch, not later in the middle of a run."""
    for variable in (MASTER_SWITCH, STRICT_SWITCH):
        read_bool(variable, True)
    for name in fix_names:
        fix_enabled(name)


@dataclass(frozen=True)
class Setting:
    """A value a fix reads beyond its on/off switch, declared in the fix's module: read and validated from its
    environment variable at ``apply()`` (or given to ``trl_vlm_fixes.apply(fix={key: value})``, which wins), then
    fixed until the next ``apply()``."""

    key: str  # its name in trl_vlm_fixes.apply(<fix>={key: value})
    variable: str
    parse: Callable[[str], Any]  # text -> value; raises SwitchValueError naming the variable and the accepted values
    default: Any
    accepted: str  # the accepted values, for README and errors
    unit: str = ""  # how the trainer-start line shows the value ("s": "600 s")

    def read(self, given: Any = None) -> tuple[Any, bool]:
        """(value, whether it was chosen: by the API or the environment, not the default)."""
        if given is not None:
            return self.parse(str(given)) if isinstance(given, str) else self._checked(given), True
        raw = os.environ.get(self.variable, "").strip()
        return (self.parse(raw), True) if raw else (self.default, False)

    def _checked(self, value: Any) -> Any:
        """A value given as a Python object: it must be one the variable could name."""
        return self.parse(str(value).lower() if isinstance(value, bool) else str(value))


def boolean(key: str, variable: str, default: bool) -> Setting:
    return Setting(key, variable, lambda raw: _parse_bool(variable, raw), default, ACCEPTED_VALUES)


def choice(key: str, variable: str, valid: tuple[str, ...], default: str, what: str) -> Setting:
    def parse(raw: str) -> str:
        found = next((name for name in valid if name.lower() == raw.strip().lower()), None)
        if found is None:
            raise SwitchValueError(
                f"{variable}={raw!r} is not {what}. Accepted values: {', '.join(valid)}. Unset it for the default "
                f"({default})."
            )
        return found

    return Setting(key, variable, parse, default, ", ".join(valid))


def _parse_bool(variable: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SwitchValueError(
        f"{variable}={raw!r} is not a valid switch value. Accepted values: {ACCEPTED_VALUES}. "
        f"Fix it with e.g. `export {variable}=0` or unset it."
    )
