"""``python -m stream_st``: the ``stream-st`` command, as ``python -m stream_st.cli`` runs it."""

import sys

from .cli import main

sys.exit(main())
