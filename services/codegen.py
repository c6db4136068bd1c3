"""Moved to inferscale_client/codegen.py (the generated gRPC code now lives in the light client package). This
name stays an alias of that module, so `from services import codegen` and `python -m services.codegen` work."""
import sys

from inferscale_client import codegen as _codegen

if __name__ == "__main__":
    print(_codegen.generate(force="--force" in sys.argv))
else:
    sys.modules[__name__] = _codegen
