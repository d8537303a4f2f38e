"""The one exception type for user errors: the CLI prints its message on one line and exits 2."""


class HvdtrainError(Exception):
    """A mistake in what the user asked for (config, paths, plug-ins), not a bug in hvdtrain."""


class ConfigError(HvdtrainError):
    """A config key, type or value that hvdtrain cannot accept."""


class Diverged(HvdtrainError):
    """The loss became NaN or infinite; every rank stops at the same step."""
