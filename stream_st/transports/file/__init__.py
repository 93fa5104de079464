"""Local files: the source (positioned reads, read-ahead, direct I/O, mappings) and the sink
(a temporary file moved into place on commit)."""
