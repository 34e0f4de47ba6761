"""The shared_model exception hierarchy.

Every error raised on purpose by this package derives from `SharedModelError`, so callers (the training CLI, the
inference service's error mapper) can catch one type. Messages always name the offending field, file or tensor.
"""

from __future__ import annotations


class SharedModelError(Exception):
    """Base class of every deliberate shared_model error."""


class ConfigError(SharedModelError, ValueError):
    """A model configuration value is invalid or unsupported; the message names the field."""


class BundleError(SharedModelError):
    """A weight bundle folder is missing a file, has an unknown model_type, or holds a missing/misshapen tensor."""


class TokenizerError(SharedModelError):
    """A tokenizer could not be trained, loaded or used."""
