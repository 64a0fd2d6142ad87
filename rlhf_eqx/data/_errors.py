"""The error type raised by the data readers."""


class DataError(ValueError):
    """Malformed or unusable input data.

    Raised for files that cannot be read as records (invalid JSON, invalid UTF-8, wrong
    record types, missing keys, an unknown format) and for inconsistent arguments. The
    message names the file and the line (or list item) where the problem was found, as
    ``path:LINE: reason``.
    """
