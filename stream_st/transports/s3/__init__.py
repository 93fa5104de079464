"""S3 and S3-compatible object stores: addresses, credentials and SigV4 signing (:mod:`.config`),
ranged reads (:mod:`.source`) and multipart uploads (:mod:`.sink`)."""
