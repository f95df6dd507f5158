"""The one base class of every error a user can cause and fix.

The command line turns a `UserError`, and only it, into one `error: <message>` line and exit code 2; anything
else is a bug and keeps its traceback. Each module's user-facing errors derive from it (and, where callers
already catch them so, from the builtin they resemble), and their messages say what to change.
"""

import difflib
import os
import sys


class UserError(Exception):
    """A problem in what the user gave (recipe, paths, model, flags, environment): the message says what to change."""


def did_you_mean(word: str, choices) -> str:
    """'; did you mean `x`?' for the nearest of `choices` (difflib's ratio >= 0.6), else ''."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def brief(e: BaseException, limit: int = 200) -> str:
    """An exception as one line of at most `limit` characters, for a message that quotes it."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text if len(text) <= limit else text[: limit - 3] + '...'}"


def run_main(main, argv=None) -> int:
    """An entry point's `main(argv)` -> its exit code; a `UserError` becomes one `error: <message>` line on
    stderr and exit code 2 (QUANTIZE_DEBUG=1 keeps the traceback), as the `pipeline` command line does."""
    try:
        code = main(argv)
    except UserError as e:
        if os.environ.get("QUANTIZE_DEBUG") == "1":
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if code is None else code
