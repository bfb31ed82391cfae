"""The HTTP API, the metrics Collector and the `status` client."""
