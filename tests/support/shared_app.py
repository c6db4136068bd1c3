"""What a folder whose modules share one running application needs (tests/service/one_app/,
tests/service/two_engines/): each folder's conftest.py starts the app in a package-scoped fixture, binds
`redis_url` and `jwt_secret` from here as its own names (`redis_url = shared_app.redis_url`: package-scoped where a
conftest binds them; this module is not a plugin, so the per-module fixtures of the same names stay everyone
else's; an assignment, not an import, so no fixture parameter shadows an import: no noqa F811), and calls
`order_folder` from its
pytest_collection_modifyitems hook, which pytest calls with every collected item.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from support.auth_fixture import new_jwt_secret
from support.redis_fixture import redis_server


@pytest.fixture(scope="package")
def redis_url():
    """The app's redis-server, for the whole folder (tests/support/redis_fixture.py's is one per module)."""
    with redis_server() as url:
        yield url


@pytest.fixture(scope="package")
def jwt_secret(tmp_path_factory):
    """The app's HS256 secret, for the whole folder (tests/support/auth_fixture.py's is one per module)."""
    return new_jwt_secret(tmp_path_factory)


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
