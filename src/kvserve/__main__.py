"""`python -m kvserve ...`: the `kvserve` command, for a checkout run without installing."""

from kvserve.entrypoints.cli import main

main()
