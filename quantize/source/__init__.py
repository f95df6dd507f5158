"""The source stage: the checkpoint resolved to a local directory, checked against its config and loaded; the
architecture tables that say where its linears are."""
