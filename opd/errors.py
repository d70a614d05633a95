"""User-facing errors.

Anything a user can cause (a bad spec, a missing file, a malformed prompt, a checkpoint that does not fit the
target) raises `OpdError`. The CLI prints it as one line and exits 2, so a multi-hour job never dies with a
traceback over a typo.
"""


class OpdError(Exception):
    """An error caused by user input; its message is one line naming the field or file and what is expected."""
