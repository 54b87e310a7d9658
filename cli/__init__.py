"""The ``pdserve`` command line (``pdserve.cli.main:main``)."""
