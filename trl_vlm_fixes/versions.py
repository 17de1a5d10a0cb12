"""Installed versus validated versions, read from package metadata so nothing heavy is imported."""

from __future__ import annotations

from importlib import metadata

from packaging.version import InvalidVersion, Version

VALIDATED = {"trl": "1.9.1", "vllm": "0.25.1"}
REPORTED_PACKAGES = ("trl", "vllm", "transformers", "torch")


def installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def installed_versions() -> dict[str, str | None]:
    return {name: installed_version(name) for name in REPORTED_PACKAGES}


def public_version(version: str) -> str:
    """Drop local tags such as ``+cu130`` so a CUDA build of a validated release still counts as validated."""
    try:
        return Version(version).public
    except InvalidVersion:
        return version.split("+", 1)[0]


def version_drift(packages: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(package, installed, validated) for each installed package that is not the validated release."""
    drift = []
    for package in packages:
        installed = installed_version(package)
        validated = VALIDATED.get(package)
        if installed is None or validated is None:
            continue
        if public_version(installed) != validated:
            drift.append((package, installed, validated))
    return drift
