"""How workers start, are watched and are stopped (``local``: processes on this host)."""
