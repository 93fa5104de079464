"""``python -m stream_st.cli``: the ``stream-st`` command."""

import sys

from . import main

sys.exit(main())
