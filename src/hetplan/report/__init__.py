"""What hetplan shows people: summaries (plain dicts, also the `--json` output) and tables."""
