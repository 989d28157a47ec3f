"""The exceptions spes-p2p raises on purpose. Anything else is a bug.

    SpesError                 base: a message meant for the user, one line
     +-- ConfigError          a setting that cannot work (also a ValueError); names the field
     |    +-- SwarmMismatch   this peer's settings or protocol differ from the swarm's manifest
     +-- DataError            a corpus that is missing, empty or unreadable
     +-- CheckpointError      a checkpoint that is missing, truncated, corrupt or does not fit

The command line prints ``str(error)`` in red and exits non-zero; it never shows a traceback for these.
"""


class SpesError(Exception):
    """Base class: the message says what is wrong and how to fix it."""


class ConfigError(SpesError, ValueError):
    """A configuration value that cannot work."""


class SwarmMismatch(ConfigError):
    """This peer's manifest, settings or protocol differ from the swarm's; the message names each one."""


class DataError(SpesError):
    """A corpus or tokenizer that cannot be used."""


class CheckpointError(SpesError):
    """A checkpoint that cannot be read or written."""
