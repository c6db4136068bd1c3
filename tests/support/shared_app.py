"""The order of the tests in a folder whose modules share one running application (tests/service/one_app/,
tests/service/two_engines/): each folder's conftest.py starts the app in a package-scoped fixture and calls
`order_folder` from its pytest_collection_modifyitems hook, which pytest calls with every collected item.
"""
from __future__ import annotations

from pathlib import Path


def order_folder(items: list, folder: Path, module_order: tuple[str, ...]) -> None:
    """The tests in `folder` by `module_order` (a module counts on what the app holds after the ones before it),
    those marked `restarts_the_app` after all others (each group in file order), at the place where the folder's
    tests were collected: the package fixture's app runs while no other module's Ray does."""
    mine = [(n, item) for n, item in enumerate(items) if folder in Path(str(item.fspath)).parents]
    if not mine:
        return

    def key(pair):
        n, item = pair
        restarts = item.get_closest_marker("restarts_the_app") is not None
        return restarts, (0 if restarts else module_order.index(Path(str(item.fspath)).name)), n

    first = mine[0][0]
    taken = {id(item) for _, item in mine}
    others = [item for item in items if id(item) not in taken]
    items[:] = others[:first] + [item for _, item in sorted(mine, key=key)] + others[first:]
