"""``python -m mxdb``: the same as the ``mxdb`` command."""

from mxdb.cli import main

main()
