"""The one exception type the CLI turns into a single error line and a non-zero exit."""


class CarryError(Exception):
    """A problem the user can act on: the message names the thing and what to do."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
