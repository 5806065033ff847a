"""pyproject.toml ships every package of the tree: setuptools is given the package list by hand
(three folders installed under one namespace), so a package left out of it would be missing from
the wheel without an error, and a data folder left out gives ``make install`` a warning box."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_and_data_folder_is_listed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = setuptools["package-dir"]  # {"autodist.schemas": "schemas", ...}
    found = set()
    for package, folder in folders.items():  # every folder Python can import, data folders included
        for sub in [ROOT / folder, *(ROOT / folder).rglob("*/")]:
            parts = sub.relative_to(ROOT / folder).parts
            if sub.is_dir() and all(part.isidentifier() and part != "__pycache__" for part in parts):
                found.add(".".join([package, *parts]))
    assert sorted(set(setuptools["packages"])) == sorted(found)
    for package, patterns in setuptools["package-data"].items():
        top = max((p for p in folders if package == p or package.startswith(p + ".")), key=len)
        folder = ROOT / folders[top] / Path(*package[len(top) + 1 :].split(".") if package != top else ())
        assert all(list(folder.glob(pattern)) for pattern in patterns), (package, patterns)
