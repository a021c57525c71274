"""``python -m cosybatch`` is the ``cosybatch`` command."""

from cosybatch.cli import main

main()
