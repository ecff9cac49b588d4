"""Every short CLI flag means one thing across all `modelpool` commands."""

from __future__ import annotations

from typing import Any

import typer.main

from modelpool.cli import app

# long options that are one meaning spelled for one command or several: `-p` picks the policy to run
# (simulate, serve) or the policies to size (capacity)
SAME = {"--policies": "--policy"}


def _commands(group: Any, path: str = "") -> dict[str, Any]:
    """Every leaf command by its full name (typer carries its own click: duck-typed)."""
    out: dict[str, Any] = {}
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            out.update(_commands(command, f"{path}{name} "))
        else:
            out[f"{path}{name}"] = command
    return out


def test_each_short_flag_means_one_thing_everywhere() -> None:
    meanings: dict[str, dict[str, list[str]]] = {}  # short flag -> long option -> commands
    commands = _commands(typer.main.get_command(app))
    assert {"simulate", "capacity", "serve", "calibrate", "estimate", "traces fetch"} <= commands.keys()
    for name, command in commands.items():
        for param in command.params:
            if param.param_type_name != "option":
                continue
            shorts = [o for o in param.opts + param.secondary_opts if not o.startswith("--")]
            longs = [o for o in param.opts if o.startswith("--")]
            for short in shorts:
                meanings.setdefault(short, {}).setdefault(SAME.get(longs[0], longs[0]), []).append(name)
    ambiguous = {short: longs for short, longs in meanings.items() if len(longs) > 1}
    assert ambiguous == {}
    assert {"-f", "-o", "-p"} <= meanings.keys()  # the check saw the commands' short flags
