"""Code that runs inside the engines (one process per rank): bootstrap, telemetry, rank API."""
