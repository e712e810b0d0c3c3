"""The words of the errors main() gives for click's own refusals and for a command that ran out of memory."""

from __future__ import annotations

from maskcli.text import shortened


def smaller(args: list[str]) -> str:
    """How to ask for less, for the command that ran out of memory."""
    command = next((arg for arg in args if not arg.startswith("-")), "")
    if command in ("inspect", "convert") or "--mask" in args:
        return "the mask file is too large to work on here: slice the part you need into a smaller file first (like mask[0, 0])"
    if command == "serve":  # serve has no --len: its sizes are the batch's
        return "the batch is too large to check here: save fewer requests (a part of the batch) and check that"
    if command == "pack":
        return "the batch is too large to check here: save fewer batch rows or tokens (a part of the batch) and check that"
    if command == "model":
        return "use shorter --lengths, fewer --new-tokens, or a larger --prefill-chunk"
    if command == "trace":
        return "the program's masks are too large to keep here: give a smaller --max-bytes, or run the program on smaller inputs"
    if command in ("attend", "verify"):
        return "use a smaller --len (or fewer batch rows or heads, a smaller --head-dim or --dtype)"
    return "use a smaller --len (or fewer batch rows or heads, or a larger --block)"


def usage_message(error, args: list[str]) -> str:
    """click's message, with the value the user gave quoted where a value was bad."""
    param = getattr(error, "param", None)
    message = getattr(error, "message", None)
    if param is None or not message or not getattr(param, "opts", None) or type(error).__name__ != "BadParameter":
        return error.format_message()
    found = None  # the last time the option is given: click keeps the last value, so that is the bad one
    for index, arg in enumerate(args):
        for opt in param.opts:
            if arg == opt and index + 1 < len(args):
                found = f"{opt} {shortened(args[index + 1], 60)!r}: {message}"
            elif arg.startswith(opt + "=") and opt.startswith("--"):
                found = f"{opt} {shortened(arg[len(opt) + 1:], 60)!r}: {message}"
    return found or error.format_message()
