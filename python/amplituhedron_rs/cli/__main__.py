"""``python -m amplituhedron_rs.cli``: the ``amplituhedron`` command."""

import sys

from amplituhedron_rs.cli import main

sys.exit(main())
