"""The guides, README and docs site: paths, tables, claims, layout."""
