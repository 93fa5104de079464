"""The format itself, with no I/O: header parsing and building, the dtype table, codecs, digests,
shard names and array conversion. Importing it imports no transport; everything here is a pure
function over bytes, so it is fuzzed and property-tested on its own."""
