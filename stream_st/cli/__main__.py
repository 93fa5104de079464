"""``python -m stream_st.cli``: the ``stream-st`` command."""

import sys

from .commands import main

sys.exit(main())
