"""The speech job around a request: its options, defined once for every front door (`job.options`)."""
