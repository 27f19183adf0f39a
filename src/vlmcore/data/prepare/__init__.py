"""`vlmcore prepare`: raw sources (`sources`) -> normalised samples (`samples`) -> webdataset
shards indexed by `energon prepare` (`dataset`); `command` is the CLI."""
