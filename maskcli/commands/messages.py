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


def _elsewhere(error) -> str | None:
    """For an option the command does not take, the other commands that take it: click offers only the command's
    options that look alike (show --stages: '--as, --save, --sizes'), where the option is another command's."""
    ctx, name = getattr(error, "ctx", None), getattr(error, "option_name", None)
    if ctx is None or not name or not name.startswith("--") or ctx.parent is None:
        return None
    group = ctx.find_root().command
    owners = [command for command, cli in getattr(group, "commands", {}).items()
              if command != ctx.info_name and any(name in param.opts for param in cli.params)]
    if not owners:
        return None
    listed = owners[0] if len(owners) == 1 else f"{', '.join(owners[:-1])} and {owners[-1]}"
    return f"No such option: {name} (it is an option of maskcli {listed})"


def usage_message(error, args: list[str]) -> str:
    """click's message, with the value the user gave quoted where a value was bad."""
    if type(error).__name__ == "NoSuchOption" and (elsewhere := _elsewhere(error)) is not None:
        return elsewhere
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
