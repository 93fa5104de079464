"""Local copies of remote objects, kept while they are read (``cache=``): see ``docs/cache.md``.

* :mod:`.config`: :class:`Cache` (where copies go; the environment), :class:`CacheMissError`;
* :mod:`.keys`: what names an object on disk (no secret ever);
* :mod:`.layout`: the files of an entry, and the Hugging Face layout for ``hf://``;
* :mod:`.store`: records, locks, digests of copies, ranges of partial copies;
* :mod:`.tee`: :class:`~.tee.TeeSource`, a remote source whose bytes are also written to the copy;
* :mod:`.resolve`: from an address to the copy, or to the remote object through a tee;
* :mod:`.manage`: listing, removing and pruning copies.
"""

from __future__ import annotations

from ...errors import CacheMissError
from .config import Cache, CacheLike, parse_size

__all__ = ["Cache", "CacheLike", "CacheMissError", "parse_size"]
