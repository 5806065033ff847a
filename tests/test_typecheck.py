"""mypy checks the calls between the packages: ``autodist.schemas``, ``autodist.planner`` and
``autodist.applier`` resolve to their real types through the symlink tree ``.typecheck/autodist``
(pyproject.toml, [tool.mypy]), so ``make test`` (which runs mypy first) fails on a wrong call
across packages. Before, mypy read the checkout's folders as ``schemas``, ``planner`` ... and every
``autodist.*`` import was ``Any``: the same calls passed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / ".typecheck" / "autodist"
WRONG_CALLS = "tests/data/typecheck/wrong_calls.py"


def _mypy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_the_type_checking_tree_holds_every_package_as_it_installs():
    """One link per package folder, and one per entry of autodist/ (a new subpackage of autodist
    needs its link, or mypy would not see it)."""
    expected = {"schemas": ROOT / "schemas", "planner": ROOT / "planner", "applier": ROOT / "applier"}
    expected |= {p.name: p for p in (ROOT / "autodist").iterdir() if p.name != "__pycache__"}
    links = {p.name: p for p in TREE.iterdir()}
    assert sorted(links) == sorted(expected)
    assert all(links[name].is_symlink() and links[name].resolve() == path.resolve() for name, path in expected.items())


def test_mypy_names_each_wrong_call_across_packages():
    out = _mypy(WRONG_CALLS).stdout
    assert out.splitlines() == [
        f'{WRONG_CALLS}:10: error: Argument 2 to "local_shape" has incompatible type "str"; expected "list[str]"  '
        "[arg-type]",
        f'{WRONG_CALLS}:11: error: Argument "moe" to "expert_limit" has incompatible type "str"; expected "bool"  '
        "[arg-type]",
        f'{WRONG_CALLS}:12: error: Argument "dtype" to "SearchRequest" has incompatible type "Literal[\'int8\']"; '
        "expected \"Literal['bf16', 'fp16', 'fp32'] | None\"  [arg-type]",
        f'{WRONG_CALLS}:13: error: Argument 1 to "to_paddle_placement" has incompatible type "list[str]"; '
        'expected "str"  [arg-type]',
    ]


def test_the_old_layout_let_the_same_calls_pass(tmp_path):
    """The configuration before the tree (the folders as top-level modules): the imports of
    ``autodist.*`` do not resolve, so the calls are unchecked and mypy reports nothing."""
    config = tmp_path / "old.ini"
    config.write_text(
        "[mypy]\nexplicit_package_bases = True\nignore_missing_imports = True\nfollow_imports = silent\n"
        f"cache_dir = {tmp_path / 'cache'}\n"
    )
    result = _mypy("--config-file", str(config), WRONG_CALLS)
    assert result.returncode == 0 and result.stdout == ""
