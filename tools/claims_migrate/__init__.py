"""claims-migrate: a one-off tool that brings a MetaMesh meta-core Redis keyspace into a metanode
data directory (docs/migration.md). Run `python -m tools.claims_migrate --help` from the
repository root, or the `tools/claims-migrate` script."""
