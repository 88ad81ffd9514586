"""The package version (a base module: the converter records it in every manifest)."""

__version__ = "0.1.0"
