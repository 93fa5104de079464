"""Where received tensor bytes land: fresh mappings (:mod:`.fresh`), memory reused once the caller
drops it (:mod:`.recycle`), and what a read hands out (:mod:`.delivery`)."""
