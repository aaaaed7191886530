"""The package version (its own module, so that code inside the package can read it without
importing the package itself)."""

VERSION = "0.2.0"
