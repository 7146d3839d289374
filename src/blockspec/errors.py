"""The one exception type users need to catch.

Every bad input (config, checkpoint, request, prompt) raises `BlockspecError`
with a message that names the problem; the CLI prints it as one line and exits 2.
"""


class BlockspecError(ValueError):
    """A user-facing error: bad config, bad checkpoint, bad request."""
