"""The errors of finding, pulling and verifying models; the CLI prints their message without a traceback."""

from __future__ import annotations


class HubError(Exception):
    """A model could not be pulled, found or verified.  The message says why
    and what to do about it; the CLI prints it without a traceback."""


class IndexUnreachableError(HubError):
    """The package index (or a file host) could not be reached at all."""


class PackageNotFoundError(HubError):
    """The index has no such package, or not the version the catalog names."""


class ArchiveChecksumError(HubError):
    """A downloaded archive does not match the sha256 the index gives."""


class ModelChecksumError(HubError):
    """The assembled GGUF does not match the catalog's sha256."""


class UnknownModelError(HubError):
    """A name that is not in the catalog."""


class ModelNotPulledError(HubError):
    """A catalog model that is not (yet) on this machine."""
