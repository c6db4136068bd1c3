"""The API's names of the answer modes ("inject", "prompt")."""
from __future__ import annotations

from inferscale_core.types import Mode

from .errors import invalid

# The API's names of the modes (the proto's AnswerRequest.mode, HTTP's inferscale_mode, metric labels): the one
# place they map to inferscale_core's Mode.
WIRE_MODES = {"inject": Mode.KV, "prompt": Mode.PI}
_MODE_NAMES = {mode: name for name, mode in WIRE_MODES.items()}


def answer_mode(mode: str) -> Mode:
    """A request's mode ("" = inject) -> Mode; INVALID_ARGUMENT naming the choices otherwise."""
    if mode == "":
        return Mode.KV
    if mode not in WIRE_MODES:
        raise invalid(f"mode must be one of {', '.join(WIRE_MODES)} (or empty for inject), got {mode!r}", "mode")
    return WIRE_MODES[mode]


def wire_mode(mode: Mode) -> str:
    """The API's name of a Mode ("inject", "prompt")."""
    return _MODE_NAMES[Mode(mode)]
