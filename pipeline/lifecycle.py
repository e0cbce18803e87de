"""`python -m pipeline promote TAG [--alias NAME]`, `rollback MODEL [--alias NAME]`, `aliases`:
move and show the aliases the service serves (serving/aliases.py). A running service follows a
move within about a second, without a restart (serving/lifecycle.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from serving.aliases import DEFAULT_ALIAS, Alias, AliasError, aliases_path, label, promote, read_aliases, rollback
from serving.manifest import ManifestError, manifest_path, read_manifest

COMMANDS = ("promote", "rollback", "aliases")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    moving = {
        "promote": ("tag", "the stored model to serve, e.g. text-embedder:57xmqhhnu2sncax4"),
        "rollback": ("model", "the model whose alias goes back one version, e.g. text-embedder"),
    }
    for command, (argument, text) in moving.items():
        sub = commands.add_parser(command, help=f"{command} an alias")
        sub.add_argument(argument, help=text)
        sub.add_argument("--alias", default=DEFAULT_ALIAS, help=f"the alias to move (default {DEFAULT_ALIAS})")
    commands.add_parser("aliases", help="each alias, the version it names and its history")
    for sub in commands.choices.values():
        sub.add_argument(
            "--manifest", type=Path, default=manifest_path(), help="the served manifest; the aliases are beside it"
        )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    path = aliases_path(args.manifest)
    try:
        if args.command == "promote":
            model = args.tag.partition(":")[0]
            unset = routed_tag(args.manifest, model, args.alias)
            print(describe(model, args.alias, promote(path, args.tag, alias=args.alias, unset=unset)))
        elif args.command == "rollback":
            print(describe(args.model, args.alias, rollback(path, args.model, alias=args.alias)))
        else:
            print(listing(args.manifest, path))
    except (AliasError, ManifestError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def routed_tag(manifest: Path, model: str, alias: str) -> str | None:
    """The manifest's tag for the route serving `model@alias`: what it serves while the alias is unset."""
    routes = read_manifest(manifest) if manifest.is_file() else ()
    return next((r.tag for _, r in routes if r is not None and (r.recipe, r.alias) == (model, alias)), None)


def describe(model: str, alias: str, entry: Alias) -> str:
    """One line: what the alias names now and before."""
    before = f" (before: {entry.history[-1].tag})" if entry.history else ""
    return f"{label(model, alias)} → {entry.current.tag}{before}"


def listing(manifest: Path, path: Path) -> str:
    """Which endpoint serves which alias, and every alias with its history, newest first."""
    lines = [f"aliases: {path}"]
    for endpoint, route in read_manifest(manifest) if manifest.is_file() else ():
        if route is not None:
            lines.append(f"/{endpoint} serves {label(route.recipe, route.alias)} (until it is set: {route.tag})")
    for model, aliases in read_aliases(path).models.items():
        for alias, entry in aliases.items():
            lines.append(describe(model, alias, entry) + f", since {entry.current.since:%Y-%m-%d %H:%M:%S} UTC")
            lines += [f"    {version.since:%Y-%m-%d %H:%M:%S}  {version.tag}" for version in reversed(entry.history)]
    return "\n".join(lines)
