"""The one base class of every error a user can cause and fix.

The command line turns a `UserError`, and only it, into one `error: <message>` line and exit code 2; anything
else is a bug and keeps its traceback. Each module's user-facing errors derive from it (and, where callers
already catch them so, from the builtin they resemble), and their messages say what to change.
"""


class UserError(Exception):
    """A problem in what the user gave (recipe, paths, model, flags, environment): the message says what to change."""
