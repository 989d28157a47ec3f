"""Package discovery (the metadata is in pyproject.toml): every package under spes_p2p/, found rather than
listed, and the command line, which lives in cli/ and is imported as spes_cli."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["spes_p2p", "spes_p2p.*"]), "spes_cli"],
    package_dir={"spes_cli": "cli"},
)
