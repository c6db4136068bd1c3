"""Build hook: the protobuf/gRPC modules of protos/ are generated when the package is BUILT (wheel, sdist ->
wheel, editable install), never at import. Everything else about the package is in pyproject.toml.

The same file builds the client-only distribution: client/setup.py is a link to it, and client/ links
inferscale_client/ and protos/ (client/pyproject.toml names what that distribution holds)."""
import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _codegen():
    # Loaded by path: the build runs before (and without) the package being importable.
    spec = importlib.util.spec_from_file_location("_inferscale_codegen", HERE / "inferscale_client" / "codegen.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildPyWithGrpc(build_py):
    """build_py + inferscale_client/_generated: into the build folder for a wheel, into the source tree for an editable
    install (where the source tree is what gets imported)."""

    def run(self):
        super().run()
        codegen = _codegen()
        if self.editable_mode:
            codegen.generate(codegen.OUT_DIR)
        else:
            codegen.generate(Path(self.build_lib) / "inferscale_client" / "_generated", force=True)


setup(cmdclass={"build_py": BuildPyWithGrpc})
