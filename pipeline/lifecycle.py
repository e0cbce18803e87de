"""`python -m pipeline promote TAG [--alias NAME]`, `rollback MODEL [--alias NAME]`, `aliases`:
move and show the aliases the service serves (serving/aliases.py). A running service follows a
move within about a second, without a restart (serving/lifecycle.py). `shadow-report [URL]`:
how each shadow compared with the model it shadows, from a running service's metrics."""

from __future__ import annotations

import argparse
import sys
import urllib.request
from collections import defaultdict
from pathlib import Path

from serving.aliases import (
    DEFAULT_ALIAS,
    Alias,
    AliasError,
    aliases_path,
    label,
    model_name,
    promote,
    read_aliases,
    rollback,
)
from serving.manifest import ManifestError, manifest_path, read_manifest, route_path

COMMANDS = ("promote", "rollback", "aliases", "shadow-report")
DEFAULT_URL = "http://127.0.0.1:3000"


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
    report = commands.add_parser("shadow-report", help="each shadow against the model it shadows")
    report.add_argument("url", nargs="?", default=DEFAULT_URL, help=f"the running service (default {DEFAULT_URL})")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.command == "shadow-report":
        try:
            print(shadow_report(read_metrics(args.url)))
        except OSError as exc:
            print(f"error: no metrics from {args.url}: {exc}", file=sys.stderr)
            return 1
        return 0
    path = aliases_path(args.manifest)
    try:
        if args.command == "promote":
            model = model_name(args.tag)
            unset = routed_tag(args.manifest, model, args.alias)
            print(describe(model, args.alias, promote(path, args.tag, alias=args.alias, unset=unset)))
        elif args.command == "rollback":
            model = model_name(args.model)
            withdraw = routed_tag(args.manifest, model, args.alias) is None
            print(describe(model, args.alias, rollback(path, model, alias=args.alias, withdraw=withdraw)))
        else:
            print(listing(args.manifest, path))
    except (AliasError, ManifestError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def routed_tag(manifest: Path, model: str, alias: str) -> str | None:
    """The manifest's tag for the route serving `model@alias`: what it serves while the alias is unset."""
    routes = read_manifest(manifest).routes().values() if manifest.is_file() else ()
    return next((r.tag for r in routes if (r.recipe, r.alias) == (model, alias)), None)


def describe(model: str, alias: str, entry: Alias | None) -> str:
    """One line: what the alias names now and before."""
    if entry is None:
        return f"{label(model, alias)} unset: its share of the traffic ends"
    before = f" (before: {entry.history[-1].tag})" if entry.history else ""
    return f"{label(model, alias)} → {entry.current.tag}{before}"


def listing(manifest: Path, path: Path) -> str:
    """Which endpoint serves which alias, and every alias with its history, newest first."""
    lines = [f"aliases: {path}"]
    for name, route in read_manifest(manifest).routes().items() if manifest.is_file() else ():
        lines.append(f"{route_path(name)} serves {label(route.recipe, route.alias)} (until it is set: {route.tag})")
    for model, aliases in read_aliases(path).models.items():
        for alias, entry in aliases.items():
            lines.append(describe(model, alias, entry) + f", since {entry.current.since:%Y-%m-%d %H:%M:%S} UTC")
            lines += [f"    {version.since:%Y-%m-%d %H:%M:%S}  {version.tag}" for version in reversed(entry.history)]
    return "\n".join(lines)


def read_metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=30) as response:
        return response.read().decode()


def shadow_report(metrics: str) -> str:
    """Per pair of models: requests compared and dropped, each measure's mean, each side's mean
    model time (serving/shadow.py exports them; means are a histogram's sum / count)."""
    from prometheus_client.parser import text_string_to_metric_families

    pairs: dict[tuple[str, str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if not sample.name.startswith("optiserve_shadow"):
                continue
            labels = sample.labels
            figures = pairs[(labels["endpoint"], labels["primary"], labels["shadow"])]
            if sample.name == "optiserve_shadow_total":
                figures[labels["outcome"]] += sample.value
            elif sample.name.endswith(("_sum", "_count")):
                figures[f"{labels.get('measure') or labels['side']}{sample.name[sample.name.rfind('_') :]}"] += (
                    sample.value
                )
    if not pairs:
        return "no shadow traffic yet"
    lines = []
    for (endpoint, primary, shadow), figures in sorted(pairs.items()):
        counts = ", ".join(f"{figures[outcome]:.0f} {outcome}" for outcome in ("compared", "dropped", "failed"))
        lines.append(f"/{endpoint}: {shadow} shadowing {primary}: {counts}")
        for measure in ("top1_agreement", "score_difference", "cosine"):
            if figures[f"{measure}_count"]:
                mean = figures[f"{measure}_sum"] / figures[f"{measure}_count"]
                lines.append(f"    {measure}: {mean:.5f} (mean of {figures[f'{measure}_count']:.0f} rows)")
        for side in ("primary", "shadow"):
            if figures[f"{side}_count"]:
                lines.append(
                    f"    {side} model call: {1000 * figures[f'{side}_sum'] / figures[f'{side}_count']:.2f} ms (mean)"
                )
    return "\n".join(lines)
