"""The storage root: local folders or S3, atomic writes, names checked at the trust boundary, leases."""
